"""KV-cache events in vLLM's wire format over a ZMQ PUB socket: GC tells routers which blocks are gone.

Routers that place requests by prefix locality (llm-d, Dynamo) learn where blocks live from vLLM's KV events,
but storage tiers upstream only announce `BlockStored`; nothing says when GC deletes a chunk from the bucket.
`KVEventPublisher.publish_removed(chunk_keys)` sends `BlockRemoved` events for deleted chunks, encoded so
that vLLM's own decoder (`msgspec.msgpack.Decoder(KVEventBatch)`) and the consumers built on it read them
unchanged. The format mirrors `vllm/distributed/kv_events.py` (this module imports neither vllm nor torch):

- one ZMQ message per batch, three frames: topic (UTF-8), sequence number (8 bytes, big-endian, from 0),
  payload, exactly as vLLM's `ZmqEventPublisher` sends them;
- payload: msgpack of a `KVEventBatch`, an array `[ts, events, data_parallel_rank]`;
- each event a map tagged `"type": "BlockRemoved"` with `block_hashes`, `medium`, `group_idx`, `locality`,
  `ownership` (fields at their default are omitted, as vLLM's structs do).

Values match the one residency our vLLM tier (`connector/tier_events.py`) reports for a chunk, "this
instance's tier holds it" (its NVMe copy or the bucket's): medium `STORAGE` and no `ownership`; Dynamo's KV
indexer drops every event that carries one, and every event whose locality is REMOTE. The locality defaults to
LOCAL, the tier's own; the admin service passes `object_locality` (LOCAL by default; REMOTE would make Dynamo
drop GC's removals). A router applies them to an instance when it reads this publisher as one more feed of
that instance (Dynamo: `POST /register` with the instance's id and a spare `dp_rank`; the batch's
`data_parallel_rank`, 0, names the engine's rank the removals apply to). A block hash is the one in the
chunk's key (`<hash hex>.bin`, FileMapper naming); like vLLM, it is sent as an int (the low 64 bits,
big-endian) unless `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`, in which case the raw bytes go out. A batch
holds one event per KV-cache group (`_g<group>` in the key).

Endpoints follow vLLM's rule: `tcp://*:port`, `ipc://` and `inproc://` bind; `tcp://host:port` connects (to a
subscriber that binds). The socket is an XPUB, which is a PUB on the wire but also sees subscriptions, so a
short-lived publisher (`kvstore gc` from cron) can wait briefly for its subscribers before sending: PUB
sockets drop what they send before a subscription arrives. vLLM's replay socket is not provided.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import msgspec
import zmq

from kvstore.errors import ConfigError
from kvstore.keys import chunk_key_to_offload_key, split_offload_key

__all__ = [
    "LOCALITY_LOCAL",
    "LOCALITY_REMOTE",
    "LOCALITY_VALUES",
    "MEDIUM_STORAGE",
    "OWNERSHIP",
    "OWNERSHIP_NVME",
    "OWNERSHIP_OBJECT",
    "BlockRemoved",
    "KVEventBatch",
    "KVEventPublisher",
    "block_hash_for_event",
    "open_publisher",
]

log = logging.getLogger(__name__)

MEDIUM_STORAGE = "STORAGE"
LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"
LOCALITY_VALUES = ("LOCAL", "REMOTE")  # vLLM's `Locality`
# The tier's residency carries no ownership: routers drop events that do (Dynamo 1.6, any string).
OWNERSHIP: str | None = None
# Earlier releases gave each copy a residency of its own (`KVStoreTier/nvme`, `KVStoreTier/object`); both
# names remain for callers and mean the one residency now.
OWNERSHIP_NVME = OWNERSHIP
OWNERSHIP_OBJECT = OWNERSHIP
_INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
_HASH_MASK = (1 << 64) - 1
_MAX_HASHES_PER_BATCH = 10_000  # GC deletes in batches of 1000; this only bounds a caller's huge list


class BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's `BlockRemoved` event, field for field (tag = class name, as vLLM's tagged union expects)."""

    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's `KVEventBatch` as it goes on the wire: `[ts, events, data_parallel_rank]`."""

    ts: float
    events: list[BlockRemoved]
    data_parallel_rank: int | None = None


def _int_hashes() -> bool:
    # Read like vLLM reads it (`bool(int(...))`, default on), so both sides agree on the hash type.
    try:
        return bool(int(os.environ.get(_INT_HASHES_ENV, "1")))
    except ValueError:
        return True


def block_hash_for_event(block_hash: bytes, *, as_int: bool | None = None) -> int | bytes:
    """The block hash as vLLM puts it in events (`maybe_convert_block_hash`)."""
    if as_int is None:
        as_int = _int_hashes()
    return int.from_bytes(block_hash, "big") & _HASH_MASK if as_int else block_hash


def _is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes `BlockRemoved` batches on one ZMQ endpoint. Thread-safe; sending never blocks (a full
    queue drops, like any PUB socket); `close()` lingers up to `linger_s` to deliver what is queued."""

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        medium: str = MEDIUM_STORAGE,
        locality: str = LOCALITY_LOCAL,
        ownership: str | None = OWNERSHIP,
        data_parallel_rank: int = 0,
        hwm: int = 100_000,
        linger_s: float = 2.0,
        first_send_wait_s: float = 1.0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"events_endpoint {endpoint!r}: expected tcp://, ipc:// or inproc://")
        self.endpoint = endpoint
        self._topic = topic.encode()
        if locality not in LOCALITY_VALUES:
            raise ConfigError(f"KV events locality must be one of {LOCALITY_VALUES}, got {locality!r}")
        self._medium = medium
        self._locality = locality
        self._ownership = ownership
        self._rank = data_parallel_rank
        self._linger_ms = int(linger_s * 1000)
        self._first_send_wait_s = first_send_wait_s
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._subscribed = False
        self._socket = (context or zmq.Context.instance()).socket(zmq.XPUB)
        try:
            self._socket.setsockopt(zmq.SNDHWM, hwm)
            self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscribe message, not only the first
            if _is_bind_endpoint(endpoint):
                self._socket.bind(endpoint)
                # What subscribers connect to (`tcp://127.0.0.1:*` binds a free port).
                self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._socket.connect(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise ConfigError(f"events_endpoint {endpoint!r}: {exc}") from None

    def wait_for_subscriber(self, timeout_s: float) -> bool:
        """Wait until a subscriber's subscription arrived (at most `timeout_s`); whether one did."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self._subscribed:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0:
                    break
                self._drain_subscriptions(remaining_ms)
            return self._subscribed

    def _drain_subscriptions(self, wait_ms: int = 0) -> None:
        if self._socket.poll(wait_ms, zmq.POLLIN):
            while self._socket.poll(0, zmq.POLLIN):
                message = self._socket.recv()
                if message[:1] == b"\x01":  # subscribe (b"\x00" is unsubscribe)
                    self._subscribed = True

    def publish_removed(self, chunk_keys: Iterable[str]) -> None:
        """Send `BlockRemoved` for the chunks (keys that name no chunk are skipped): one batch, with one
        event per KV-cache group. GC's `on_removed` hook."""
        by_group: dict[int, list[int | bytes]] = {}
        as_int = _int_hashes()
        for key in chunk_keys:
            try:
                block_hash, group = split_offload_key(chunk_key_to_offload_key(key))
            except ConfigError:
                log.debug("not a chunk key, no event: %r", key)
                continue
            by_group.setdefault(group, []).append(block_hash_for_event(block_hash, as_int=as_int))
        events = [
            BlockRemoved(
                block_hashes=hashes[start : start + _MAX_HASHES_PER_BATCH],
                medium=self._medium,
                group_idx=group,
                locality=self._locality,
                ownership=self._ownership,
            )
            for group, hashes in sorted(by_group.items())
            for start in range(0, len(hashes), _MAX_HASHES_PER_BATCH)
        ]
        if events:
            self._send(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank))

    def _send(self, batch: KVEventBatch) -> None:
        payload = self._encoder.encode(batch)
        if self._first_send_wait_s > 0:
            # Subscribers (re)connecting to a fresh socket would miss the first batch; wait for them once.
            self.wait_for_subscriber(self._first_send_wait_s)
            self._first_send_wait_s = 0
        with self._lock:
            try:
                self._drain_subscriptions()  # keep the XPUB's incoming queue short
                seq = next(self._seq)
                self._socket.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # events are advisory: GC goes on without them
                log.warning("KV events: could not publish to %s: %s", self.endpoint, exc)

    def close(self) -> None:
        with self._lock:
            self._socket.close(linger=self._linger_ms)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_publisher(endpoint: str, **options: Any) -> KVEventPublisher | None:
    """A publisher for a configured endpoint; `None` when events are off (empty endpoint)."""
    return KVEventPublisher(endpoint, **options) if endpoint else None
