"""The engine as vLLM's process runs it, against a real S3 server and a real LMDB-indexed NVMe cache: probes,
loads, stores, bad chunks. The node agent, where a test needs uploads or admission, runs beside it."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvstore.access import read_access_records
from kvstore.agent.node_agent import NodeAgent
from kvstore.cache import NVMeCache, ReadStatus
from kvstore.chunk import HEADER_BLOCK, Codec, encode, encode_legacy, parse_header, stored_size
from kvstore.engine import EngineThreads, Presence, TieredStore
from kvstore.errors import StoreUnavailable
from kvstore.metrics import EngineMetrics
from kvstore.stores import MemoryStore, ObjectStore
from kvstore.stores.base import Buffer
from kvstore.stores.s3 import S3Store
from kvstore.warm_fetch import fetch_into_cache
from tests.cache_helpers import locate, read_chunk, read_status
from tests.conftest import S3Server
from tests.engine_helpers import CHUNK, fill, keys, load, payload
from tests.helpers import FakeClock, sample, wait_for

MakeEngine = Callable[..., TieredStore]
StartAgent = Callable[..., NodeAgent]


@pytest.mark.parametrize("codec", list(Codec))
def test_store_then_load_from_nvme_and_object(
    s3_store: ObjectStore,
    cache: NVMeCache,
    metrics: EngineMetrics,
    tmp_path: Path,
    codec: Codec,
    make_engine: MakeEngine,
    start_agent: StartAgent,
) -> None:
    names = keys(8)
    engine = make_engine(s3_store, cache, metrics, codec=codec)
    start_agent(cache, s3_store)
    outcome = engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
    assert outcome.written == 8 and outcome.kept == 8
    wait_for(lambda: cache.backlog().chunks == 0, what="the agent's uploads")
    assert all(s3_store.exists_many(names))
    assert engine.lookup(names) == [Presence.LOCAL] * 8
    assert load(engine, names) == [payload(i) for i in range(8)]
    assert sample(metrics, "kvstore:read_bytes_total", tier="nvme") == 8 * CHUNK
    assert sample(metrics, "kvstore:write_bytes_total", tier="nvme") > 0
    assert sample(metrics, "kvstore:write_seconds_count", tier="nvme") == 8  # one observation per chunk
    assert sample(metrics, "kvstore:write_bytes_total", tier="object") == 0, "the engine uploads nothing"
    assert sample(metrics, "kvstore:read_seconds_count", tier="nvme") == 8
    with open(locate(cache, names[0]).path, "rb") as f:  # type: ignore[union-attr]
        assert parse_header(f.read(HEADER_BLOCK), names[0]).codec is codec, "stored with the codec set"
    again = engine.store_many([(names[0], payload(0))])
    assert again.skipped == 1

    # A fresh node sharing only the bucket: hits come from the object store, then from its own NVMe once its
    # agent has admitted them.
    with NVMeCache(tmp_path / "other", budget_bytes=64 * (CHUNK + HEADER_BLOCK)) as fresh_cache:
        other = make_engine(s3_store, fresh_cache, EngineMetrics(CollectorRegistry()))
        start_agent(fresh_cache, s3_store)
        assert other.lookup(names) == [Presence.REMOTE] * 8
        assert load(other, names) == [payload(i) for i in range(8)]
        other.housekeeping()  # hands the hits to the agent now (it runs every fraction of a second anyway)
        wait_for(lambda: all(fresh_cache.contains_many(names)), what="the agent to admit the object hits")
        assert other.lookup(names) == [Presence.LOCAL] * 8
        assert fresh_cache.backlog().chunks == 0, "object hits are not uploaded again"


def test_lookup_without_waiting_probes_in_background(
    s3_store: ObjectStore, cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    names = keys(5)
    fill(s3_store, names[:3])
    reader = make_engine(s3_store, cache, metrics)
    first = reader.lookup(names, wait=False)
    assert set(first) <= {Presence.PENDING, Presence.REMOTE, Presence.MISS}
    answer = first
    deadline = time.monotonic() + 10
    while Presence.PENDING in answer and time.monotonic() < deadline:
        time.sleep(0.02)
        answer = reader.lookup(names, wait=False)
    assert answer == [Presence.REMOTE] * 3 + [Presence.MISS] * 2


def wait_answers(engine: TieredStore, names: Sequence[str]) -> list[Presence]:
    engine.probe_async(names)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answers = [engine.lookup_cached(k) for k in names]
        if Presence.PENDING not in answers:
            return answers
        time.sleep(0.01)
    pytest.fail("probe never answered")


def test_the_probe_wakes_a_waiting_scheduler_when_it_answers(
    s3_store: ObjectStore,
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
) -> None:
    """An idle vLLM step waits on the tier until it has news: the probe says when it answered, whatever the
    answer (in the bucket, nowhere, on this node), and an upload's news in the change log does not wake it."""
    names = keys(3, "wake")
    fill(s3_store, names[:1])
    engine = make_engine(s3_store, cache, metrics)
    woken = threading.Event()
    engine.wake_on_answers(woken.set)
    other = make_engine(s3_store, cache, EngineMetrics(CollectorRegistry()))  # another process of the node
    assert other.store_many([(names[2], payload(2))]).written == 1
    for key, answer in ((names[0], Presence.REMOTE), (names[1], Presence.MISS), (names[2], Presence.LOCAL)):
        woken.clear()
        assert wait_answers(engine, [key]) == [answer]
        assert woken.wait(5), f"no wake-up for {answer}"
    start_agent(cache, s3_store)
    wait_for(lambda: cache.backlog().chunks == 0, what="the agent's upload")
    woken.clear()
    engine.housekeeping()  # reads the node's change log now: the upload is news, not an answer
    assert not woken.is_set()


def test_probe_fetches_hits_so_the_load_needs_no_second_round(
    s3_store: ObjectStore, cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    names = keys(6, "prefetch")
    fill(s3_store, names[:4])
    engine = make_engine(s3_store, cache, metrics)
    assert wait_answers(engine, names) == [Presence.REMOTE] * 4 + [Presence.MISS] * 2
    held = sample(metrics, "kvstore:prefetch_bytes")
    assert held == sum(len(s3_store.get(k) or b"") for k in names[:4])
    # The objects go away after the probe: the load is served from what the probe fetched, verified.
    s3_store.delete_many(names[:4])
    assert load(engine, names[:4]) == [payload(i) for i in range(4)]
    assert sample(metrics, "kvstore:read_bytes_total", tier="object") == 4 * len(payload(0))
    assert sample(metrics, "kvstore:prefetch_bytes") == 0
    # Each prefetched blob serves one load; the next one copies this node's copy, which waits for its NVMe
    # write (the store, where the objects are gone now, is not asked).
    assert load(engine, names[:1]) == [payload(0)]
    assert sample(metrics, "kvstore:read_bytes_total", tier="object") == 4 * len(payload(0))
    assert sample(metrics, "kvstore:read_bytes_total", tier="nvme") == len(payload(0))


class SlowGets(MemoryStore):
    """An in-memory store whose GETs of keys under `slow/` wait until `gate` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.waiting = 0
        self.answered = 0
        self.asked = 0  # GETs of any key

    def get(self, key: str) -> bytes | None:
        self.asked += 1
        if "/slow/" in key:
            self.waiting += 1
            self.gate.wait(30)
        found = super().get(key)
        if "/slow/" in key:
            self.answered += 1
        return found


def test_a_repeat_load_before_the_hits_are_on_nvme_asks_the_bucket_nothing(
    cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    """Object hits wait for their NVMe write while the engine's foreground is busy (here a probe whose GET
    hangs); a repeat load meanwhile copies the verified bytes held for that write, with no GET."""
    store = SlowGets()
    ready, slow = keys(3, "again"), keys(1, "slow")
    fill(store, ready + slow)
    engine = make_engine(store, cache, metrics, io_workers=4)
    engine.probe_async(slow)
    wait_for(lambda: store.waiting == 1, what="the probe's GET to hang")
    assert load(engine, ready) == [payload(i) for i in range(3)]
    asked = store.asked
    assert load(engine, ready) == [payload(i) for i in range(3)]
    assert store.asked == asked, "the repeat load asked the bucket"
    assert not any(cache.contains_many(ready)), "written while the probe was out"
    assert sample(metrics, "kvstore:read_bytes_total", tier="nvme") == 3 * CHUNK  # this node's copy
    store.gate.set()
    wait_for(lambda: all(cache.contains_many(ready)), what="the write once the engine is quiet")


def test_prefetched_chunks_load_while_the_io_workers_wait_on_the_network(
    cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    store = SlowGets()
    ready, slow = keys(4, "ready"), keys(2, "slow")
    fill(store, ready + slow)
    engine = make_engine(store, cache, metrics, io_workers=2)
    assert wait_answers(engine, ready) == [Presence.REMOTE] * 4
    engine.probe_async(slow)  # both io workers now wait on GETs that do not return
    wait_for(lambda: store.waiting >= 2, what="both io workers blocked")
    loaded: list[list[bytes | None]] = []
    loader = threading.Thread(target=lambda: loaded.append(load(engine, ready)))
    loader.start()
    loader.join(10)  # the held chunks need no io worker: this must not wait for the gate
    done_before_gate = not loader.is_alive()
    store.gate.set()
    loader.join(30)
    assert done_before_gate
    assert loaded == [[payload(i) for i in range(4)]]


def test_a_frozen_store_costs_a_load_its_deadline_once_then_the_breaker_answers(
    cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    store = SlowGets()
    names = keys(3, "slow")
    fill(store, names)
    engine = make_engine(store, cache, metrics, prefetch_bytes=0, load_timeout_s=0.5, cooldown=30)
    start = time.monotonic()
    assert load(engine, names) == [None] * 3
    first = time.monotonic() - start
    assert sample(metrics, "kvstore:object_store_up") == 0
    assert sample(metrics, "kvstore:object_store_errors_total", op="get") >= 1
    start = time.monotonic()
    assert load(engine, names) == [None] * 3  # the breaker is open: nobody waits on the store
    second = time.monotonic() - start
    store.gate.set()
    assert first < 10, f"a load waited {first:.1f} s on a store that does not answer"
    assert second < first
    assert store.waiting == 3, "no GET was sent while the breaker was open"


class SlowGetsOnOneThread(SlowGets):
    """`SlowGets` whose batches take the one-thread path (`get_each`), as an S3 store's do."""

    gets_many_at_once = True


@pytest.mark.parametrize("slow_store", [SlowGets, SlowGetsOnOneThread])
def test_a_download_that_ends_after_the_deadline_never_touches_the_buffer(
    cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine, slow_store: type[SlowGets]
) -> None:
    """vLLM reuses a row the moment its load reports: a GET that answers after the deadline must not copy
    into it."""
    store = slow_store()
    names = keys(2, "slow")
    fill(store, names)
    engine = make_engine(store, cache, metrics, prefetch_bytes=0, load_timeout_s=0.3, cooldown=30)
    rows = [memoryview(bytearray(b"\xee" * CHUNK)) for _ in names]
    assert engine.load_into(list(zip(names, rows, strict=True))) == [False, False]
    store.gate.set()
    # On threads both GETs were in flight; one thread asks nothing more of an abandoned batch.
    late = 1 if slow_store.gets_many_at_once else 2
    wait_for(lambda: store.answered == late, what="the late GETs to answer")
    time.sleep(0.2)  # what a late copy would need
    assert all(bytes(row) == b"\xee" * CHUNK for row in rows), "a late download wrote into a reused row"


def test_a_bucket_hit_costs_one_get_node_wide_and_a_repeat_load_none(
    s3_server: S3Server,
    s3_store: S3Store,
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
) -> None:
    """A fresh node's hit: the probe's GET is the load, and the bytes it verified are the ones admitted to
    NVMe (nobody fetches them again, neither this engine nor the node agent); the next load asks nothing."""
    names = keys(6, "one-get")
    fill(s3_store, names)
    agent = start_agent(cache, s3_store)
    engine = make_engine(s3_store, cache, metrics)
    before = s3_server.requests(s3_store.bucket)
    engine.probe_prefixes([names])
    wait_for(lambda: all(engine.lookup_cached(k) is Presence.REMOTE for k in names), what="the probe")
    assert load(engine, names) == [payload(i) for i in range(6)]
    wait_for(lambda: all(cache.contains_many(names)), what="the hits to reach NVMe")
    hints = agent.hints_received
    engine.housekeeping()  # whatever the engine tells the agent about these hits, it has now told it
    wait_for(lambda: agent.hints_received > hints, what="the agent to take the engine's hints")
    served = s3_server.requests(s3_store.bucket) - before
    assert (served.get, served.put, served.list) == (6, 0, 0)
    assert load(engine, names) == [payload(i) for i in range(6)]
    assert (s3_server.requests(s3_store.bucket) - before).get == 6  # the repeat load came from NVMe


def test_prefix_probe_asks_first_keys_first_and_stops_a_chain_at_its_miss(
    s3_store: ObjectStore,
    cache: NVMeCache,
    metrics: EngineMetrics,
    monkeypatch: pytest.MonkeyPatch,
    make_engine: MakeEngine,
) -> None:
    first, second = keys(5, "chain-a"), keys(3, "chain-b")
    fill(s3_store, first[:2] + second)  # the first request's prefix ends after two chunks
    asked: list[str] = []
    real_get = s3_store.get_chunk

    def recording_get(key: str) -> object:
        asked.append(key)
        return real_get(key)

    real_get_each = s3_store.get_each

    def recording_get_each(
        next_item: Callable[[], tuple[object, str] | None],
        on_object: Callable[[object, object], None],
        *,
        at_once: int,
        on_found: object = None,  # not passed on: each chain's rest waits for its first answer, as ranked
    ) -> None:
        def recorded() -> tuple[object, str] | None:
            item = next_item()
            if item is not None:
                asked.append(item[1])
            return item

        real_get_each(recorded, on_object, at_once=at_once)

    monkeypatch.setattr(s3_store, "get_chunk", recording_get)
    monkeypatch.setattr(s3_store, "get_each", recording_get_each)
    engine = make_engine(s3_store, cache, metrics, io_workers=1)
    engine.probe_prefixes([first, second])
    wait_for(lambda: engine.lookup_cached(second[-1]) is not Presence.PENDING, what="the probe")
    # Rank by rank over the requests, and nothing past the first request's miss.
    assert asked == [first[0], second[0], first[1], second[1], first[2], second[2]]
    assert [engine.lookup_cached(k) for k in first] == [Presence.REMOTE] * 2 + [Presence.MISS] + [
        Presence.PENDING
    ] * 2
    assert [engine.lookup_cached(k) for k in second] == [Presence.REMOTE] * 3


def test_a_chain_the_bucket_never_saw_costs_one_get(
    s3_server: S3Server, s3_store: S3Store, cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    """A new conversation's first turn: its chain's first key is a 404, and nothing after it is asked (a
    request can use no chunk past its first miss); a chain found in the bucket is fetched whole meanwhile."""
    cold, found = keys(12, "cold"), keys(12, "found")
    fill(s3_store, found)
    engine = make_engine(s3_store, cache, metrics)
    before = s3_server.requests(s3_store.bucket)
    engine.probe_prefixes([cold, found])
    wait_for(lambda: engine.probes_in_flight == 0, what="the probe")
    assert [engine.lookup_cached(k) for k in found] == [Presence.REMOTE] * 12
    assert engine.lookup_cached(cold[0]) is Presence.MISS
    asked = s3_server.requests(s3_store.bucket) - before
    assert (asked.get, asked.get_missing) == (13, 1)


@pytest.mark.parametrize("head_first", [False, True], ids=["answer-slow", "body-slow"])
def test_a_found_chain_goes_on_while_another_chains_first_key_is_in_flight(
    s3_store: S3Store,
    cache: NVMeCache,
    metrics: EngineMetrics,
    monkeypatch: pytest.MonkeyPatch,
    make_engine: MakeEngine,
    head_first: bool,
) -> None:
    """The first chain's first answer is slow (held back here until every other GET has answered): the
    second chain is fetched whole without waiting for it, and the first chain's rest is asked once it is
    back; or, where the answer's head said the key exists before its body came (``head_first``), at once."""
    slow, quick = keys(4, "slow-first"), keys(4, "quick")
    fill(s3_store, slow + quick)
    asked: list[str] = []
    real_get_each = s3_store.get_each

    def slow_first_answer(
        next_item: Callable[[], tuple[object, str] | None],
        on_object: Callable[[object, Buffer | None], None],
        *,
        at_once: int,
        on_found: Callable[[object], None] | None = None,
    ) -> None:
        held: list[tuple[object, Buffer | None]] = []

        def recorded() -> tuple[object, str] | None:
            item = next_item()
            if item is not None:
                asked.append(item[1])
                if head_first and item[0] == (0, 0) and on_found is not None:
                    on_found(item[0])  # its head came at once; its body is the slow part
            return item

        def answer(tag: object, blob: Buffer | None) -> None:
            if tag == (0, 0):  # (chain, rank): the slow chain's first key
                held.append((tag, blob))
            else:
                on_object(tag, blob)

        real_get_each(recorded, answer, at_once=at_once)
        for tag, blob in held:
            on_object(tag, blob)

    monkeypatch.setattr(s3_store, "get_each", slow_first_answer)
    engine = make_engine(s3_store, cache, metrics)
    engine.probe_prefixes([slow, quick])
    wait_for(lambda: engine.probes_in_flight == 0, what="the probe")
    if head_first:  # the slow chain's rest went out with the quick chain's first key, before any answer
        assert asked == [slow[0], quick[0], *slow[1:], *quick[1:]]
    else:
        assert asked == [slow[0], *quick, *slow[1:]]
    assert [engine.lookup_cached(k) for k in slow + quick] == [Presence.REMOTE] * 8


def test_a_pending_key_is_probed_once_until_answered_or_asked_long_ago(
    cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    now = [0.0]
    store = SlowGets()  # the probe of a key under slow/ stays in flight until the gate opens
    engine = make_engine(store, cache, metrics, clock=lambda: now[0])
    key = keys(1, "slow")[0]
    assert engine.needs_probe(key)
    engine.probe_prefixes([[key]])
    assert not engine.needs_probe(key)
    now[0] = 2.0  # the injected clock decides when it is asked again
    assert engine.needs_probe(key)
    store.gate.set()


def test_a_lookup_changes_nothing_but_its_counters(
    s3_store: ObjectStore, cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    names = keys(2, "pure-lookup")
    fill(s3_store, names[:1])
    engine = make_engine(s3_store, cache, metrics)
    assert wait_answers(engine, names) == [Presence.REMOTE, Presence.MISS]
    for _ in range(3):
        assert [engine.lookup_cached(k) for k in names] == [Presence.REMOTE, Presence.MISS]
        engine.end_of_step()  # the scheduler's step ends: its lookups are counted
    assert sample(metrics, "kvstore:chunk_hits_total", tier="object") >= 3
    assert engine.probes_in_flight == 0


@pytest.mark.parametrize("prefetch", [0, 256 << 20], ids=["head", "get"])
def test_probe_answers_expire_after_their_ttls(
    cache: NVMeCache, metrics: EngineMetrics, prefetch: int, make_engine: MakeEngine
) -> None:
    """ "Missing" is trusted for `probe_miss_ttl_s` (another node may upload the chunk any moment), "in the
    object store" for `probe_hit_ttl_s` (only GC takes chunks away); then the key is probed again."""
    clock = FakeClock()
    store = MemoryStore()
    engine = make_engine(
        store,
        cache,
        metrics,
        clock=clock,
        probe_miss_ttl_s=2.0,
        probe_hit_ttl_s=600.0,
        prefetch_bytes=prefetch,
    )
    [name] = keys(1, f"ttl-{prefetch}")
    assert wait_answers(engine, [name]) == [Presence.MISS]
    fill(store, [name])  # another node uploads it
    clock.advance(1.9)
    assert engine.lookup_cached(name) is Presence.MISS, "a fresh miss answer is trusted"
    clock.advance(0.2)
    assert engine.lookup_cached(name) is Presence.PENDING, "an expired miss answer is asked again"
    assert wait_answers(engine, [name]) == [Presence.REMOTE]
    assert load(engine, [name]) == [payload(0)]
    store.delete(name)  # GC takes it
    clock.advance(599)
    assert engine.lookup_cached(name) is Presence.REMOTE, "a fresh hit answer is trusted"
    clock.advance(2)
    assert engine.lookup_cached(name) is Presence.PENDING, "an expired hit answer is asked again"
    assert wait_answers(engine, [name]) == [Presence.MISS]


def test_corrupt_prefetched_chunk_is_never_served(
    s3_store: ObjectStore, cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    names = keys(1, "prefetch-corrupt")
    fill(s3_store, names)
    blob = bytearray(s3_store.get(names[0]) or b"")
    blob[HEADER_BLOCK + 5] ^= 0x10
    s3_store.put(names[0], bytes(blob))
    engine = make_engine(s3_store, cache, metrics)
    # Verified as it arrived; the answer is published only once the judgement is done (counted, removed),
    # so the load below cannot race the deletion and fetch the bad object again.
    assert wait_answers(engine, names) == [Presence.MISS]
    assert sample(metrics, "kvstore:checksum_failures_total", tier="object") == 1
    assert s3_store.get(names[0]) is None  # proven corrupt, in a format this reader knows: removed
    assert load(engine, names) == [None]
    assert sample(metrics, "kvstore:checksum_failures_total", tier="object") == 1


def test_probe_by_head_when_prefetch_is_off(
    s3_store: ObjectStore, cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    names = keys(2, "prefetch-off")
    fill(s3_store, names)
    engine = make_engine(s3_store, cache, metrics, prefetch_bytes=0)
    assert wait_answers(engine, names) == [Presence.REMOTE] * 2
    s3_store.delete_many(names)
    assert load(engine, names) == [None, None]  # nothing was held: the load asked the store


def test_corrupt_nvme_copy_is_discarded_and_the_object_serves(
    s3_store: ObjectStore,
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
) -> None:
    names = keys(2, "corrupt-nvme")
    engine = make_engine(s3_store, cache, metrics)
    start_agent(cache, s3_store)
    engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
    wait_for(lambda: cache.backlog().chunks == 0, what="the uploads")
    located = locate(cache, names[0])
    assert located is not None
    with open(located.path, "r+b") as f:
        f.seek(HEADER_BLOCK + 10)
        byte = f.read(1)
        f.seek(HEADER_BLOCK + 10)
        f.write(bytes([byte[0] ^ 0x40]))
    assert load(engine, names[:1]) == [payload(0)]
    assert sample(metrics, "kvstore:checksum_failures_total", tier="nvme") == 1
    assert not os.path.exists(located.path), "the bad copy is removed, not left for the next read"
    engine.housekeeping()
    wait_for(lambda: cache.contains_many(names[:1])[0], what="the agent to re-admit the good copy")
    again = locate(cache, names[0])
    assert again is not None and again.path != located.path
    assert read_chunk(cache, names[0]) == payload(0)
    events = engine.take_events()
    assert any(e.key == names[0] and e.tier == "nvme" and e.removed for e in events), "routers are told"


def test_corrupt_object_is_a_miss_and_removed(
    s3_store: ObjectStore, cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    names = keys(1, "corrupt-obj")
    fill(s3_store, names)
    blob = bytearray(s3_store.get(names[0]) or b"")
    blob[HEADER_BLOCK + 3] ^= 0x01
    s3_store.put(names[0], bytes(blob))
    engine = make_engine(s3_store, cache, metrics, prefetch_bytes=0)
    assert load(engine, names) == [None]
    assert sample(metrics, "kvstore:checksum_failures_total", tier="object") == 1
    assert s3_store.get(names[0]) is None
    assert engine.lookup(names) == [Presence.MISS]


def test_a_chunk_that_fails_to_load_is_not_promised_again(
    s3_store: ObjectStore, cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    """A chunk the probe found and the load could not get answers MISS (for `probe_miss_ttl_s`): the
    scheduler would otherwise be promised it, and fail, on every step."""
    names = keys(1, "vanished")
    fill(s3_store, names)
    engine = make_engine(s3_store, cache, metrics, prefetch_bytes=0)
    assert wait_answers(engine, names) == [Presence.REMOTE]
    s3_store.delete(names[0])  # GC took it between the probe and the load
    assert load(engine, names) == [None]
    assert engine.lookup_cached(names[0]) is Presence.MISS
    assert sample(metrics, "kvstore:load_failures_total", tier="object") == 1


# -- a valid chunk under another key's name is a miss on every read path, and never copied anywhere


def _swap_nvme(cache: NVMeCache, victim: str, donor: str, how: str) -> None:
    src, dst = locate(cache, donor), locate(cache, victim)
    assert src is not None and dst is not None
    if how == "copy":
        shutil.copyfile(src.path, dst.path)
    else:  # rename: the donor's file takes the victim's name
        os.replace(src.path, dst.path)


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("how", ["copy", "rename"])
def test_a_chunk_swapped_on_nvme_is_never_served(
    tmp_path: Path, metrics: EngineMetrics, codec: Codec, how: str, make_engine: MakeEngine
) -> None:
    names = keys(2, "swap-nvme")
    with NVMeCache(tmp_path / "nvme", budget_bytes=10**8) as cache:
        engine = make_engine(None, cache, metrics, codec=codec)  # NVMe only: nothing can mask a bad read
        engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
        _swap_nvme(cache, names[1], names[0], how)
        assert read_status(cache, names[1])[0] is ReadStatus.CORRUPT
        assert load(engine, names[1:]) == [None]
        assert not cache.contains_many(names[1:])[0], "the swapped copy is discarded"
        assert sample(metrics, "kvstore:checksum_failures_total", tier="nvme") == 1


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("path", ["probe", "load", "warm", "admission"])
def test_a_chunk_swapped_in_the_bucket_is_never_served_nor_cached(
    s3_store: ObjectStore,
    tmp_path: Path,
    metrics: EngineMetrics,
    codec: Codec,
    path: str,
    make_engine: MakeEngine,
) -> None:
    names = keys(2, f"swap-obj-{path}-{codec.name}")
    s3_store.put(names[0], encode(names[0], payload(0), codec).to_bytes())
    s3_store.put(names[1], encode(names[0], payload(0), codec).to_bytes())  # names[0]'s chunk, copied
    with NVMeCache(tmp_path / "nvme", budget_bytes=10**8) as cache:
        victim = names[1]
        if path in ("probe", "load"):
            engine = make_engine(s3_store, cache, metrics, prefetch_bytes=256 << 20 if path == "probe" else 0)
            if path == "probe":
                assert wait_answers(engine, [victim]) == [Presence.MISS]
            assert load(engine, [victim]) == [None]
        else:  # warming's prefetch
            threads = EngineThreads(io_workers=2, disk_workers=2, upload_workers=1)
            try:
                done = fetch_into_cache(cache, s3_store, threads, [victim], metrics)
            finally:
                threads.join(5)
            assert done.written == 0 and done.missing == 1
        assert not cache.contains_many([victim])[0], "never copied into NVMe"
        assert s3_store.get(victim) is None, "a chunk provably not this key's is removed from its name"
        assert s3_store.get(names[0]) is not None, "the genuine chunk is untouched"


# -- a reader never deletes what it does not understand


def test_a_reader_with_another_buffer_size_deletes_nothing(
    s3_store: ObjectStore,
    tmp_path: Path,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
) -> None:
    names = keys(2, "buffer-size")
    with NVMeCache(tmp_path / "nvme", budget_bytes=10**8) as cache:
        writer = make_engine(s3_store, cache, metrics)
        agent = start_agent(cache, s3_store)
        writer.store_many([(k, payload(i)) for i, k in enumerate(names)])
        wait_for(lambda: cache.backlog().chunks == 0, what="the uploads")
        # A misconfigured node: its slots are smaller than the chunks.
        assert load(writer, names[:1], size=CHUNK // 2) == [None]
        agent.stop()
        assert cache.contains_many(names[:1])[0], "the NVMe copy stays"
    with NVMeCache(tmp_path / "fresh", budget_bytes=10**8) as fresh:
        for prefetch in (0, 256 << 20):
            reader = make_engine(s3_store, fresh, metrics, prefetch_bytes=prefetch)
            if prefetch:
                wait_answers(reader, names[1:])
            assert load(reader, names[1:], size=CHUNK // 2) == [None]
            reader.close()
    assert all(s3_store.exists_many(names)), "the shared objects stay"
    assert sample(metrics, "kvstore:unreadable_chunks_total", tier="nvme") == 1
    assert sample(metrics, "kvstore:unreadable_chunks_total", tier="object") >= 2
    assert sample(metrics, "kvstore:checksum_failures_total", tier="object") == 0


@pytest.mark.parametrize("variant", ["version 1", "newer version", "not a kvstore chunk"])
def test_an_object_this_reader_cannot_read_is_a_miss_and_stays(
    s3_store: ObjectStore, cache: NVMeCache, metrics: EngineMetrics, variant: str, make_engine: MakeEngine
) -> None:
    name = keys(1, f"foreign-{variant.replace(' ', '-')}")[0]
    current = bytearray(encode(name, payload(0)).to_bytes())
    blob = {
        "version 1": encode_legacy(payload(0)),
        "newer version": bytes(current[:4]) + b"\x03" + bytes(current[5:]),
        "not a kvstore chunk": payload(0),  # e.g. vLLM's own obj tier writing raw KV under the same layout
    }[variant]
    s3_store.put(name, blob)
    for prefetch in (0, 256 << 20):
        engine = make_engine(s3_store, cache, metrics, prefetch_bytes=prefetch)
        if prefetch:
            assert wait_answers(engine, [name]) == [Presence.MISS]
        assert load(engine, [name]) == [None]
        engine.close()
    assert s3_store.get(name) == blob
    assert sample(metrics, "kvstore:checksum_failures_total", tier="object") == 0


def test_an_nvme_file_this_reader_cannot_read_is_dropped_once_the_bucket_has_it(
    s3_store: ObjectStore,
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
) -> None:
    """A node-local file replaced by a chunk of a newer format: while it is the only copy (waiting for
    upload) it is left alone; once the bucket has the chunk, its entry goes (a miss here, never a read before
    every miss) and the bucket's copy serves."""
    names = keys(2, "replaced")
    engine = make_engine(s3_store, cache, metrics, prefetch_bytes=0, codec=Codec.ZSTD)
    engine.store_many([(k, payload(i)) for i, k in enumerate(names)])

    def newer_version(key: str) -> None:
        located = locate(cache, key)
        assert located is not None
        with open(located.path, "r+b") as f:
            f.seek(4)
            f.write(b"\x03")  # a format version this reader does not know

    newer_version(names[0])
    assert load(engine, names[:1]) == [None], "not in the bucket yet: nothing serves it"
    assert cache.contains_many(names[:1]) == [True], "its only copy stays"
    start_agent(cache, s3_store)
    wait_for(lambda: s3_store.exists_many(names) == [False, True], what="the readable chunk's upload")
    wait_for(lambda: cache.backlog().chunks == 1, what="the journal to record it")
    assert cache.contains_many(names[:1]) == [True], "the agent leaves the unreadable one alone too"
    newer_version(names[1])
    assert load(engine, names[1:]) == [payload(1)]  # from the bucket
    assert not cache.contains_many(names[1:])[0], "the entry of the unreadable file is gone"
    assert sample(metrics, "kvstore:unreadable_chunks_total", tier="nvme") == 2


def test_an_nvme_write_failure_is_a_write_failure(
    tmp_path: Path, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    with NVMeCache(tmp_path / "nvme", budget_bytes=10**8) as cache:
        engine = make_engine(MemoryStore(), cache, metrics)
        chunks = tmp_path / "nvme" / "chunks"
        shutil.rmtree(chunks)
        chunks.write_bytes(b"not a directory")  # every chunk file write now fails
        outcome = engine.store_many([(k, payload(i)) for i, k in enumerate(keys(3, "write-fail"))])
        assert outcome.failed == 3 and outcome.kept == 0
        assert sample(metrics, "kvstore:write_failures_total", tier="nvme") == 3
        assert sample(metrics, "kvstore:stores_dropped_total", reason="write_error") == 3


def test_an_eviction_says_whether_it_took_the_last_copy(
    tmp_path: Path, metrics: EngineMetrics, make_engine: MakeEngine, start_agent: StartAgent
) -> None:
    """Routers are told a chunk is gone only with its last copy: an evicted chunk the bucket has is still
    this tier's; one evicted before its upload is not."""
    store = MemoryStore()
    with NVMeCache(tmp_path / "nvme", budget_bytes=4 * (CHUNK + HEADER_BLOCK)) as cache:
        engine = make_engine(store, cache, metrics)
        first, second, third = keys(2, "first"), keys(2, "second"), keys(2, "third")
        engine.store_many([(k, payload(i)) for i, k in enumerate(first)])
        agent = start_agent(cache, store)
        wait_for(lambda: cache.backlog().chunks == 0, what="the uploads of the first two")
        agent.stop()
        engine.store_many([(k, payload(10 + i)) for i, k in enumerate(second)])  # full: nothing evicted
        engine.store_many([(k, payload(20 + i)) for i, k in enumerate(third)])  # evicts the uploaded two
        engine.store_many([(k, payload(30 + i)) for i, k in enumerate(keys(2, "fourth"))])  # and the next
        engine.housekeeping()
        removed = {e.key: e.last_copy for e in engine.take_events() if e.removed}
    assert removed == {**dict.fromkeys(first, False), **dict.fromkeys(second, True)}


def test_lookups_read_the_answers_only_and_the_probe_reads_the_index(
    cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    """The scheduler's lookups never read the index: py-lmdb lets go of the GIL around each read, and the
    scheduler thread then waits behind whichever thread takes it. The engine that stored a chunk knows it at
    once; another engine on the node answers PENDING, and its probe finds the chunk in the index without
    asking the store."""
    names = keys(3, "first-lookup")
    writer = make_engine(None, cache, metrics)
    writer.store_many([(k, payload(i)) for i, k in enumerate(names[:2])])
    assert [writer.lookup_cached(k) for k in names[:2]] == [Presence.LOCAL, Presence.LOCAL]

    asked: list[str] = []

    class WatchedStore(MemoryStore):
        def get_chunk(self, key: str) -> Buffer | None:
            asked.append(key)
            return super().get_chunk(key)

        def exists_many(self, keys: Sequence[str]) -> list[bool]:
            asked.extend(keys)
            return super().exists_many(keys)

    other = make_engine(WatchedStore(), cache, EngineMetrics(CollectorRegistry()))  # knows nothing yet
    assert [other.lookup_cached(k) for k in names] == [Presence.PENDING] * 3
    other.probe_prefixes([names])
    answers = [Presence.LOCAL, Presence.LOCAL, Presence.MISS]
    wait_for(lambda: [other.lookup_cached(k) for k in names] == answers)
    assert asked == [names[2]]  # the one chunk the node does not hold


def test_absent_keys_asked_every_step_cost_one_request_each_per_miss_ttl(
    s3_server: S3Server,
    s3_store: S3Store,
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
) -> None:
    """A waiting request looks its keys up on every scheduler step; for keys the bucket does not have, the
    store is asked once per key until the "missing" answer expires, then once more: counted at the server."""
    clock = FakeClock(0.0)
    absent = keys(3, "absent")
    engine = make_engine(s3_store, cache, metrics, clock=clock, probe_miss_ttl_s=2.0)
    before = s3_server.requests(s3_store.bucket)
    for _ in range(100):  # 100 scheduler steps, 0.1 s apart: 10 s, five "missing" lifetimes
        for key in absent:
            if engine.lookup_cached(key) is Presence.PENDING and engine.needs_probe(key):
                engine.probe_prefixes([[key]])
        wait_for(lambda: engine.probes_in_flight == 0, what="the step's probes")
        engine.end_of_step()
        clock.advance(0.1)
    asked = s3_server.requests(s3_store.bucket) - before
    assert asked.get <= len(absent) * (10 / 2.0 + 1)
    assert asked.get >= len(absent) * 4  # each expiry did ask again
    assert [engine.lookup_cached(k) for k in absent] == [Presence.MISS] * 3


def test_a_tail_asked_of_this_node_only_costs_the_bucket_nothing(
    s3_server: S3Server,
    s3_store: S3Store,
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
) -> None:
    """A request's short tail (`probe_tail_tokens`): the index answers, what is not on NVMe is a miss, and
    the bucket is not asked, even for a chunk it holds; asked again as an ordinary chain, the bucket is."""
    on_node, in_bucket, new = keys(3, "tail")
    engine = make_engine(s3_store, cache, metrics)
    assert engine.store_many([(on_node, payload(0))]).written == 1
    fill(s3_store, [in_bucket])
    other = make_engine(s3_store, cache, EngineMetrics(CollectorRegistry()))  # knows nothing of the store
    before = s3_server.requests(s3_store.bucket)
    other.probe_prefixes([], node_only=[[on_node, in_bucket, new]])
    wait_for(lambda: other.probes_in_flight == 0, what="the node-only probe")
    assert [other.lookup_cached(k) for k in (on_node, in_bucket, new)] == [
        Presence.LOCAL,
        Presence.MISS,
        Presence.MISS,
    ]
    assert (s3_server.requests(s3_store.bucket) - before).get == 0
    assert sample(other.metrics, "kvstore:tail_probes_on_node_total") == 3
    third = make_engine(s3_store, cache, EngineMetrics(CollectorRegistry()))
    third.probe_prefixes([[in_bucket]], node_only=[[in_bucket]])  # also asked as a chain: the bucket is asked
    wait_for(lambda: third.lookup_cached(in_bucket) is Presence.REMOTE, what="the bucket's answer")


# -- what the engine hears from the node (issue 30's mutations that nothing caught) ------------------------


def test_stored_hints_wait_for_an_agent_and_reach_it(
    s3_store: ObjectStore,
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
) -> None:
    """With no agent there, what an engine stored is kept to tell the next one (GC sees a chunk as used from
    its store on): once an agent runs, the access records name every chunk."""
    engine = make_engine(s3_store, cache, metrics)
    names = keys(4, "unsent")
    assert engine.store_many([(k, payload(i)) for i, k in enumerate(names)]).written == 4
    engine.housekeeping()  # nobody listens: the hints wait
    start_agent(cache, s3_store, access_flush_s=0.2)
    engine.housekeeping()

    def recorded() -> set[str]:
        return {k for _, _, batch in read_access_records(s3_store) for k in batch}

    wait_for(lambda: set(names) <= recorded(), what="the stored chunks in the access records")


def test_each_change_of_the_node_is_one_event(
    tmp_path: Path, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    """The engine reads the change log from where it stopped: each eviction is announced once, however
    often the log is read."""
    with NVMeCache(tmp_path / "nvme", budget_bytes=4 * (CHUNK + HEADER_BLOCK)) as cache:
        engine = make_engine(None, cache, metrics)
        names = keys(10, "once")
        for i, name in enumerate(names):
            engine.store_many([(name, payload(i))])  # from the fifth on, each evicts the oldest
        for _ in range(3):
            engine.housekeeping()
        removed = [e.key for e in engine.take_events() if e.removed]
    assert removed == names[:6]


def test_an_agents_eviction_of_a_chunk_never_uploaded_ends_its_residency(
    tmp_path: Path, metrics: EngineMetrics, make_engine: MakeEngine, start_agent: StartAgent
) -> None:
    """The agent evicts chunks the bucket does not have (no uploader runs): each was the last copy, and
    routers must hear so."""
    budget = 10 * (CHUNK + HEADER_BLOCK)
    with NVMeCache(tmp_path / "nvme", budget_bytes=budget) as cache:
        engine = make_engine(MemoryStore(), cache, metrics)  # queued for upload; nothing uploads them
        names = keys(10, "last-copy")
        engine.store_many([(k, payload(i)) for i, k in enumerate(names)])  # the whole budget: over 95%
        start_agent(cache, None)  # evicts, uploads nothing
        wait_for(lambda: cache.used_bytes() <= 0.9 * budget, what="the agent's eviction")
        engine.housekeeping()
        removed = {e.key: e.last_copy for e in engine.take_events() if e.removed}
    assert removed and set(removed.values()) == {True}, removed


def test_a_discarded_nvme_copy_is_no_longer_answered_as_on_this_node(
    s3_store: ObjectStore,
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
) -> None:
    names = keys(1, "discarded")
    engine = make_engine(s3_store, cache, metrics)
    start_agent(cache, s3_store)
    engine.store_many([(names[0], payload(0))])
    wait_for(lambda: cache.backlog().chunks == 0, what="the upload")
    engine.housekeeping()
    located = locate(cache, names[0])
    assert located is not None
    with open(located.path, "r+b") as f:
        f.seek(HEADER_BLOCK + 10)
        f.write(b"\xff\xfe")
    # The change log would correct the answer too, at the engine's next housekeeping: hold it off.
    with engine._housekeeping_lock:
        assert load(engine, names) == [payload(0)], "the bucket's copy serves"
        assert engine.lookup_cached(names[0]) is Presence.REMOTE, "the node's copy is gone"


class Switchable(MemoryStore):
    """A real in-memory store that can be taken down: every call fails while `down` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def get(self, key: str) -> bytes | None:
        if self.down:
            raise StoreUnavailable("down")
        return super().get(key)

    def get_chunk(self, key: str) -> Buffer | None:
        if self.down:
            raise StoreUnavailable("down")
        return super().get_chunk(key)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        if self.down:
            raise StoreUnavailable("down")
        return super().exists_many(keys)


def test_an_uploaded_chunk_stays_a_local_hit_also_while_the_store_is_down(
    cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine, start_agent: StartAgent
) -> None:
    """ "In the bucket" must not replace "on this node": with the store down, the bucket's copy answers MISS,
    the node's still serves."""
    store = Switchable()
    engine = make_engine(store, cache, metrics, prefetch_bytes=0)
    start_agent(cache, store)
    names = keys(2, "stays-local")
    engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
    wait_for(lambda: cache.backlog().chunks == 0, what="the uploads")
    engine.housekeeping()  # the change log: both reached the bucket
    assert [engine.lookup_cached(k) for k in names] == [Presence.LOCAL] * 2
    store.down = True
    assert load(engine, keys(1, "elsewhere")) == [None]  # a GET fails: the breaker opens
    assert not engine.store_available
    assert [engine.lookup_cached(k) for k in names] == [Presence.LOCAL] * 2
    assert load(engine, names) == [payload(0), payload(1)]


def test_a_long_chain_is_answered_in_a_few_waves_not_chunk_by_chunk(
    cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each publication of answers becomes a promotion job at vLLM's next step: a 40-chunk request on a new
    node is answered in waves of a quarter of its chain (the last at its end), not once per GET."""
    store = MemoryStore()
    names = keys(40, "waves")
    fill(store, names)
    engine = make_engine(store, cache, metrics)
    published: list[int] = []
    real_in_bucket = engine._outcomes.in_bucket

    def recording(keys: Sequence[str]) -> None:
        published.append(len(keys))
        real_in_bucket(keys)

    monkeypatch.setattr(engine._outcomes, "in_bucket", recording)
    engine.probe_prefixes([names])
    wait_for(lambda: engine.probes_in_flight == 0, what="the probe")
    assert [engine.lookup_cached(k) for k in names] == [Presence.REMOTE] * 40
    assert sum(published) == 40 and len(published) <= 5


def test_object_hits_are_not_admitted_to_a_cache_that_cannot_keep_them(
    tmp_path: Path, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    """A full cache whose least recently used chunk was used moments ago would evict each admitted hit long
    before its prompt returns: the hits are served, and not written."""
    store = MemoryStore()
    remote = keys(2, "remote")
    fill(store, remote, first=100)
    with NVMeCache(tmp_path / "nvme", budget_bytes=4 * (CHUNK + HEADER_BLOCK)) as cache:
        assert cache.keeps_for_s(CHUNK + HEADER_BLOCK) is None, "room: nothing would be evicted"
        engine = make_engine(store, cache, metrics)
        local = keys(4, "local")
        engine.store_many([(k, payload(i)) for i, k in enumerate(local)])  # the whole budget, just used
        horizon = cache.keeps_for_s(CHUNK + HEADER_BLOCK)
        assert horizon is not None and 0 <= horizon < 60
        assert load(engine, remote) == [payload(100), payload(101)]
        engine.close()  # writes what its admission queued
        assert not any(cache.contains_many(remote)) and all(cache.contains_many(local))
        assert sample(metrics, "kvstore:admissions_skipped_total") == 2


def _free_buffers(length: int) -> int:
    """Free buffers of the process's GET-body pool that a ``length``-byte body would be given."""
    from kvstore.stores import buffers

    return len(buffers._POOL._free.get(buffers._size_class(length), ()))


def test_a_new_node_maps_a_burst_of_get_bodies_before_its_first_load(
    s3_store: S3Store, cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    payload_bytes = (1 << 20) + 300 * 1024  # a size no other test's bodies have
    body = stored_size(payload_bytes)
    engine = make_engine(s3_store, cache, metrics, prefetch_bytes=4 * body)
    engine.expect_chunks(payload_bytes)
    wait_for(lambda: _free_buffers(body) >= 4, what="four bodies' memory mapped")
    # Compressed chunks vary in length, and a store whose reads use no pooled buffers needs none.
    other = (1 << 20) + 700 * 1024
    make_engine(s3_store, cache, EngineMetrics(CollectorRegistry()), codec=Codec.ZSTD).expect_chunks(other)
    make_engine(MemoryStore(), cache, EngineMetrics(CollectorRegistry())).expect_chunks(other)
    time.sleep(0.5)
    assert _free_buffers(stored_size(other)) == 0
