"""A real router credits an instance with what KVStoreTier holds: real vLLM engines (CPU backend, tiny model),
the tier on a real S3 server and NVMe cache, NVIDIA Dynamo's KV indexer subscribed to the engine's events.

One story, told once per module (engine starts are the cost) and checked by the tests below:

1. An engine serves prompts A and C (2,944 tokens each, 23 blocks); the router credits them on every tier.
2. Four other prompts push A and C out of the engine's KV cache, the CPU tier and the NVMe cache; the bucket
   still holds them, so the router must still credit them, on disk. Then prompt B, which stays on NVMe.
3. GC deletes A from the bucket (B and C are kept by a pin) and publishes its removals on a feed the router
   reads for the instance: the credit for A ends, C's stays.
4. The engine restarts (same events endpoint). The router ignores a restarted engine's batches until the
   instance is registered again (`test_router_events.py`), which drops its credits. The engine serves B
   from its NVMe cache and C from the bucket, and four other prompts push both out of the engine and the CPU
   tier again: both must stay credited, on disk. Nothing the engine stores announces them (B's NVMe copy
   was there all along, C's is the node agent's admission), so the tier must say it served them (a
   `tier.py` change: `tier_events.announce_served`).

Callbacks between prompts only record what the router answers (they must not raise while an engine waits);
the tests assert on the records.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import KVEventSubscriber, require_vllm

require_vllm()

from kvstore.connector.harness.router import (  # noqa: E402
    Credit,
    DynamoIndexer,
    dynamo_indexer,
    free_port,
    unavailable_reason,
)

if (_reason := unavailable_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402

from kvstore.agent.uploads import wait_uploaded  # noqa: E402
from kvstore.cache import NVMeCache  # noqa: E402
from kvstore.connector.configs import cpu_tiering_config  # noqa: E402
from kvstore.connector.harness.engine_runner import EngineRun, run_engine  # noqa: E402
from kvstore.events import KVEventPublisher, block_hash_for_event  # noqa: E402
from kvstore.gc import run_gc  # noqa: E402
from kvstore.keys import chunk_key_to_offload_key, split_offload_key  # noqa: E402
from kvstore.stores import ObjectStore  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = 128  # tokens per block on the CPU backend, as the engine registers with the router
PROMPT = 23 * BLOCK  # 2,944 tokens
HELD = Credit(
    PROMPT, PROMPT, PROMPT
)  # on the GPU (counts for every tier: the router's figures are cumulative)
ON_DISK = Credit(0, 0, PROMPT)  # in a storage tier only
NO_CREDIT = Credit()
NVME_BYTES = 14 * 2**20  # holds A and B (46 chunks of 256 KiB + headers); the fillers push them out
_WAIT_S = 30.0  # bounds a broken run only


def tokens(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


A, B, C = tokens(1), tokens(2), tokens(3)
FILLERS = [tokens(10 + i) for i in range(4)]
FILLERS_AFTER_RESTART = [tokens(20 + i) for i in range(4)]


@dataclass
class Story:
    """What the router answered at each step, and the facts the steps rely on."""

    held_a: Credit = NO_CREDIT
    evicted: dict[str, Credit] = field(default_factory=dict)
    after_gc: dict[str, Credit] = field(default_factory=dict)
    on_nvme: dict[str, int] = field(default_factory=dict)  # chunks of each prompt on NVMe after step 2
    in_bucket: dict[str, int] = field(default_factory=dict)  # and in the bucket
    gc_deleted: int = 0
    restart_registered: Credit = NO_CREDIT
    restart_cached: dict[str, int] = field(default_factory=dict)
    restart_held: dict[str, Credit] = field(default_factory=dict)
    restart_evicted: dict[str, Credit] = field(default_factory=dict)
    storage_events: list[Any] = field(default_factory=list)


def poll(read: Callable[[], Credit], until: Callable[[Credit], bool]) -> Credit:
    """The router's answer once `until` holds, or its last answer after `_WAIT_S` (never raises)."""
    deadline = time.monotonic() + _WAIT_S
    while True:
        try:
            value = read()
        except Exception:  # a callback between prompts must not raise; the test sees an empty credit
            value = Credit()
        if until(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def uploads_settle(cache_dir: Path) -> None:
    """Wait until the node's agent has uploaded what the last prompt stored (an empty upload journal, and no
    new change to the cache meanwhile), within `_WAIT_S`; never raises. The story means to check what the
    tier says of chunks that reached the bucket: on a loaded machine a slow agent can leave the next prompt
    evicting a chunk whose upload never happened, which the tier rightly announces as lost
    (`tier_events.ends_residency`)."""
    deadline = time.monotonic() + _WAIT_S
    try:
        with NVMeCache(cache_dir, NVME_BYTES) as cache:
            last = -1
            while time.monotonic() < deadline and (seq := cache.change_seq()) != last:
                last = seq
                wait_uploaded(cache, deadline - time.monotonic())
                time.sleep(0.25)  # stores the engine has not committed yet
    except Exception:  # a callback between prompts must not raise
        return


def event_hash(chunk_key: str) -> int | bytes:
    """The block hash the engine's events carry for a chunk (one block per chunk)."""
    return block_hash_for_event(split_offload_key(chunk_key_to_offload_key(chunk_key))[0])


class Guarded:
    """`between` for `run_engine`, never raising (the engine would wait for it forever): the first error is
    kept, and `check` raises it once the engine has finished."""

    def __init__(self, between: Callable[[int], None]) -> None:
        self._between = between
        self._error: Exception | None = None

    def __call__(self, i: int) -> None:
        if self._error is None:
            try:
                self._between(i)
            except Exception as exc:
                self._error = exc

    def check(self) -> None:
        if self._error is not None:
            raise self._error


def chunk_counts(keys: list[str], prompt_hashes: dict[str, set[int | bytes]]) -> dict[str, int]:
    """How many of each prompt's chunks are among `keys` (chunk keys)."""
    hashes = {event_hash(k) for k in keys}
    return {name: len(prompt & hashes) for name, prompt in prompt_hashes.items()}


@pytest.fixture(scope="module")
def story(tiny_model: Path, s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    cache_dir = tmp_path_factory.mktemp("router") / "nvme"
    port, replay_port = free_port(), free_port()
    model, instance = "tiny-router", random.SystemRandom().randrange(1, 1 << 30)
    told = Story()
    with dynamo_indexer() as router, s3_server.bucket() as bucket, s3_server.store(bucket) as store:
        tier = {
            "type": "KVStoreTier",
            "module_path": "kvstore.connector.tier",
            "store_url": f"s3://{bucket}",
            "s3_endpoint": s3_server.endpoint,
            "cache_dir": str(cache_dir),
            "cache_bytes": NVME_BYTES,
            "enable_kv_events": True,
            "stats_interval_s": 0.05,
        }
        config = cpu_tiering_config(tier, cpu_bytes=8 * 2**20)
        config["kv_connector_extra_config"]["self_describing_kv_events"] = True

        def engine(prompts: list[list[int]], between: Callable[[int], None]) -> EngineRun:
            def after_uploads(i: int) -> None:
                uploads_settle(cache_dir)
                between(i)

            run = run_engine(
                tiny_model,
                prompts,
                kv_transfer_config=config,
                kv_events_config={
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{port}",  # the router connects to the engine
                    "replay_endpoint": f"tcp://*:{replay_port}",
                },
                env={
                    "AWS_ACCESS_KEY_ID": s3_server.access_key,
                    "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
                },
                max_tokens=4,
                max_model_len=4096,
                kv_cache_bytes=10 * 2**20,  # 40 blocks
                settle_s=2.0,
                between=(guarded := Guarded(after_uploads)),
            )
            guarded.check()
            return run

        def credit(prompt: list[int]) -> Callable[[], Credit]:
            return lambda: router.credit(instance, prompt, model=model)

        def register() -> None:
            router.register(
                instance,
                f"tcp://127.0.0.1:{port}",
                model=model,
                block_size=BLOCK,
                replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
            )

        log = KVEventSubscriber(connect_to=f"tcp://127.0.0.1:{port}")  # every batch of both engines
        try:
            _first_run(engine, register, credit, told)
            prompt_hashes = _prompt_hashes(log.events())
            in_bucket = _chunk_keys(store)
            with NVMeCache(cache_dir, NVME_BYTES) as cache:
                on_nvme = [
                    k for k, here in zip(in_bucket, cache.contains_many(in_bucket), strict=True) if here
                ]
            told.on_nvme = chunk_counts(on_nvme, prompt_hashes)
            told.in_bucket = chunk_counts(in_bucket, prompt_hashes)
            _gc(router, instance, model, store, prompt_hashes, credit, told)
            _restart(engine, router, instance, model, register, credit, told)
            told.storage_events = [e for e in log.events() if getattr(e, "medium", None) == "STORAGE"]
        finally:
            log.close()
        yield told


def _first_run(
    engine: Callable[..., EngineRun],
    register: Callable[[], None],
    credit: Callable[[list[int]], Callable[[], Credit]],
    told: Story,
) -> None:
    warmup, tail = tokens(100, 2 * BLOCK), tokens(101, 2 * BLOCK)
    prompts = [warmup, A, C, *FILLERS, B, tail]

    def between(i: int) -> None:
        if i == 0:
            register()  # the engine is up: the router connects at once, and replays what it missed
        elif i == 1:
            told.held_a = poll(credit(A), lambda c: c.gpu == PROMPT)
        elif i == 2 + len(FILLERS):  # after the last filler
            for name, prompt in (("A", A), ("C", C)):
                told.evicted[name] = poll(credit(prompt), lambda c: c.cpu == 0)

    engine(prompts, between)


def _prompt_hashes(events: list[Any]) -> dict[str, set[int | bytes]]:
    """The block hashes of A, B and C, from the engine's BlockStored for its own KV cache."""
    out: dict[str, set[int | bytes]] = {}
    for event in events:
        if isinstance(event, BlockStored) and event.medium == "GPU":
            for name, prompt in (("A", A), ("B", B), ("C", C)):
                if name not in out and list(event.token_ids[: len(prompt)]) == prompt:
                    out[name] = set(event.block_hashes[: PROMPT // BLOCK])
    return out


def _chunk_keys(store: ObjectStore) -> list[str]:
    return [o.key for o in store.list() if o.key.endswith(".bin")]


def _gc(
    router: DynamoIndexer,
    instance: int,
    model: str,
    store: ObjectStore,
    prompt_hashes: dict[str, set[int | bytes]],
    credit: Callable[[list[int]], Callable[[], Credit]],
    told: Story,
) -> None:
    kept = prompt_hashes.get("B", set()) | prompt_hashes.get("C", set())
    pinned = {k for k in _chunk_keys(store) if event_hash(k) in kept}
    with KVEventPublisher("tcp://127.0.0.1:*") as publisher:
        # GC's feed: the same instance, a spare rank; its batches name rank 0, the engine's.
        router.register(instance, publisher.endpoint, model=model, block_size=BLOCK, dp_rank=1)
        publisher.wait_for_subscriber(_WAIT_S)
        report = run_gc(
            store,
            ttl_seconds=0,
            grace_seconds=0,
            now=time.time() + 3600,
            pinned=pinned,
            on_removed=publisher.publish_removed,
        )
        told.gc_deleted = report.deleted
        told.after_gc["A"] = poll(credit(A), lambda c: c.disk == 0)
        told.after_gc["C"] = credit(C)()


def _restart(
    engine: Callable[..., EngineRun],
    router: DynamoIndexer,
    instance: int,
    model: str,
    register: Callable[[], None],
    credit: Callable[[list[int]], Callable[[], Credit]],
    told: Story,
) -> None:
    warmup, tail = tokens(200, 2 * BLOCK), tokens(201, 2 * BLOCK)
    prompts = [warmup, B, C, *FILLERS_AFTER_RESTART, tail]
    served = {"B": B, "C": C}

    def between(i: int) -> None:
        if i == 0:
            # The restarted engine numbers its batches from 0: register the instance again, or the router
            # drops them all. That forgets every credit, the GC feed's registration included.
            router.unregister(instance, model=model)
            register()
            told.restart_registered = credit(C)()
        elif i in (1, 2):
            name = "B" if i == 1 else "C"
            told.restart_held[name] = poll(credit(served[name]), lambda c: c.gpu == PROMPT)
        elif i == len(prompts) - 2:
            for name, prompt in served.items():
                told.restart_evicted[name] = poll(credit(prompt), lambda c: c.cpu == 0)

    run = engine(prompts, between)
    told.restart_cached = {"B": run.results[1].num_cached_tokens, "C": run.results[2].num_cached_tokens}


def test_credited_while_the_engine_holds_it(story: Story) -> None:
    assert story.held_a == HELD


def test_credited_while_only_the_bucket_holds_it(story: Story) -> None:
    # The steps did what they are for: the engine and the CPU tier dropped A and C (the router says so) and
    # so did the NVMe cache, while the bucket has every chunk; B stayed on NVMe.
    chunks = PROMPT // BLOCK
    assert {name: (c.gpu, c.cpu) for name, c in story.evicted.items()} == {"A": (0, 0), "C": (0, 0)}
    assert story.on_nvme == {"A": 0, "B": chunks, "C": 0}, "NVME_BYTES does not fit the story any more"
    assert story.in_bucket == {"A": chunks, "B": chunks, "C": chunks}
    assert story.evicted == {"A": ON_DISK, "C": ON_DISK}


def test_not_credited_once_gc_deleted_it(story: Story) -> None:
    assert story.gc_deleted >= PROMPT // BLOCK
    assert story.after_gc == {"A": NO_CREDIT, "C": ON_DISK}


def test_the_tier_events_on_the_wire(story: Story) -> None:
    """What the engine published for the tier: self-describing stores, LOCAL, no ownership (routers drop
    anything else), and no removal: nothing this node stored lost its last copy."""
    stored = [e for e in story.storage_events if isinstance(e, BlockStored)]
    assert stored and {(e.locality, e.ownership, e.block_size) for e in stored} == {("LOCAL", None, BLOCK)}
    assert all(len(e.token_ids) == BLOCK for e in stored)
    assert not [e for e in story.storage_events if isinstance(e, BlockRemoved)]


def test_a_restarted_engine_is_credited_for_what_it_serves(story: Story) -> None:
    assert story.restart_registered == NO_CREDIT  # registering again forgot the first engine's credits
    assert story.restart_cached == {"B": PROMPT, "C": PROMPT}  # from the NVMe cache and from the bucket
    assert story.restart_held == {"B": HELD, "C": HELD}


@pytest.mark.parametrize("name", ["B", "C"], ids=["served-from-nvme", "served-from-the-bucket"])
def test_a_restarted_engine_keeps_the_credit_for_what_it_served(story: Story, name: str) -> None:
    assert story.restart_evicted[name] == ON_DISK
