"""KV events: what `KVEventPublisher` sends is what vLLM's own decoder reads, with our tier's values."""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from kvstore.errors import ConfigError
from kvstore.events import KVEventPublisher, open_publisher
from kvstore.keys import KVCacheGroup, Namespace, make_offload_key

kv_events = pytest.importorskip("vllm.distributed.kv_events")
_DECODER = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)

NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def chunk_key(i: int, group: int = 0) -> str:
    return NS.chunk_key(make_offload_key(block_hash(i), group))


class Subscriber:
    """A router's side: a SUB socket receiving on its own thread (a ZMQ socket only handles its connection
    handshake, and so only sends its subscription, while its owner is inside a ZMQ call)."""

    def __init__(self, *, bind: bool = True, connect_to: str = "") -> None:
        self.messages: queue.Queue[list[bytes]] = queue.Queue()
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            port = self._sock.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        else:
            self._sock.connect(connect_to)
            self.endpoint = connect_to
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                self.messages.put(self._sock.recv_multipart())

    def next(self) -> tuple[bytes, int, Any]:
        """The next batch as (topic, seq, batch decoded by vLLM's own decoder)."""
        topic, seq, payload = self.messages.get(timeout=30)  # only bounds a broken run; never a timing check
        return topic, int.from_bytes(seq, "big"), _DECODER.decode(payload)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)


@pytest.fixture
def subscriber() -> Iterator[Subscriber]:
    sub = Subscriber()
    yield sub
    sub.close()


def test_vllm_decodes_block_removed_batches(subscriber: Subscriber) -> None:
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    with KVEventPublisher(subscriber.endpoint) as publisher:
        publisher.publish_removed([chunk_key(1), chunk_key(2), chunk_key(3, group=1), "_meta/gc/lease.json"])
        publisher.publish_removed([chunk_key(4)])
        topic, seq, batch = subscriber.next()
        assert (topic, seq) == (b"", 0)
        assert isinstance(batch, kv_events.KVEventBatch) and batch.data_parallel_rank == 0
        by_group = {event.group_idx: event for event in batch.events}
        assert set(by_group) == {0, 1}
        assert all(isinstance(event, kv_events.BlockRemoved) for event in batch.events)
        # The hashes as vLLM itself would publish them for these blocks.
        expected = [maybe_convert_block_hash(BlockHash(block_hash(i))) for i in (1, 2)]
        assert by_group[0].block_hashes == expected
        assert by_group[1].block_hashes == [maybe_convert_block_hash(BlockHash(block_hash(3)))]
        event = by_group[0]
        assert (event.medium, event.locality, event.ownership) == (
            kv_events.MEDIUM_STORAGE,
            "REMOTE",
            "KVStoreTier",
        )
        _, seq, second = subscriber.next()
        assert seq == 1 and second.events[0].block_hashes == [
            maybe_convert_block_hash(BlockHash(block_hash(4)))
        ]


def test_medium_locality_and_ownership_match_our_tier() -> None:
    from kvstore.connector.tier import KVStoreTier
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import _MEDIUM_TO_EVENT_STR
    from vllm.v1.kv_offload.base import Locality

    from kvstore import events

    # The tier reports object-store chunks as REMOTE storage owned by its type name (`KVStoreTier`).
    assert _MEDIUM_TO_EVENT_STR[KVStoreTier.medium] == events.MEDIUM_STORAGE
    assert Locality.REMOTE.value == events.LOCALITY_REMOTE
    assert KVStoreTier.__name__ == events.OWNERSHIP


def test_raw_hashes_when_vllm_sends_bytes(subscriber: Subscriber, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    with KVEventPublisher(subscriber.endpoint, topic="kv") as publisher:
        publisher.publish_removed([chunk_key(7)])
        topic, _, batch = subscriber.next()
    assert topic == b"kv" and batch.events[0].block_hashes == [block_hash(7)]


def test_bind_endpoint_and_configuration() -> None:
    with KVEventPublisher("tcp://127.0.0.1:*") as publisher:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:") and not publisher.endpoint.endswith("*")
        subscriber = Subscriber(bind=False, connect_to=publisher.endpoint)
        try:
            assert publisher.wait_for_subscriber(30)
            publisher.publish_removed([chunk_key(9)])
            assert subscriber.next()[2].events[0].group_idx == 0
        finally:
            subscriber.close()
    assert open_publisher("") is None
    with pytest.raises(ConfigError, match="events_endpoint"):
        KVEventPublisher("http://127.0.0.1:5557")
    with pytest.raises(ConfigError, match="events_endpoint"):
        KVEventPublisher("tcp://127.0.0.1:notaport")
