"""The node agent's work, beside a real engine on a real cache: uploads whatever the store does, admission of
object hits, eviction, touches, access records, counters. The agent runs in this process here; its process
of its own (lock, priority, start, stop) is `test_supervisor`'s."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvstore.access import read_access_records
from kvstore.agent.node_agent import AgentAlreadyRunning, NodeAgent
from kvstore.cache import NVMeCache
from kvstore.chunk import HEADER_BLOCK
from kvstore.engine import EngineThreads, Presence, TieredStore
from kvstore.engine.node_counters import counter_name
from kvstore.errors import CacheError, StoreError, StoreUnavailable
from kvstore.metrics import EngineMetrics
from kvstore.stores import MemoryStore, ObjectStore
from tests.cache_helpers import cached_keys, locate
from tests.engine_helpers import CHUNK, fill, keys, load, payload
from tests.helpers import sample, wait_for

MakeEngine = Callable[..., TieredStore]
StartAgent = Callable[..., NodeAgent]


class GatedStore(MemoryStore):
    """A real in-memory store whose writes wait on a gate: stands in for a store that has become slow."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.gate.wait(30)
        super().put(key, data)


def test_a_slow_store_never_holds_up_stores(
    cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine, start_agent: StartAgent
) -> None:
    store = GatedStore()
    engine = make_engine(store, cache, metrics)
    start_agent(cache, store, upload_workers=1)
    names = keys(12, "slow")
    outcome = engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
    assert outcome.written == 12, "stores go to NVMe and the journal whatever the store does"
    assert engine.lookup(names) == [Presence.LOCAL] * 12
    assert sample(metrics, "kvstore:upload_backlog_chunks") >= 11
    assert sample(metrics, "kvstore:upload_backlog_bytes") >= 11 * CHUNK
    store.gate.set()
    wait_for(lambda: cache.backlog().chunks == 0, what="the uploads")
    assert sample(metrics, "kvstore:upload_backlog_chunks") == 0
    assert engine.close().not_uploaded == 0
    for i, name in enumerate(names):
        blob = store.get(name)
        assert blob is not None and blob[HEADER_BLOCK : HEADER_BLOCK + CHUNK] == payload(i)


def test_finished_uploads_reach_the_engines_as_events_and_answers(
    s3_store: ObjectStore,
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
) -> None:
    engine = make_engine(s3_store, cache, metrics)
    names = keys(3, "events")
    engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
    start_agent(cache, s3_store)
    wait_for(lambda: cache.backlog().chunks == 0, what="the uploads")
    engine.housekeeping()  # reads the node's change log
    events = {(e.key, e.tier, e.removed) for e in engine.take_events()}
    assert {(k, "nvme", False) for k in names} <= events
    assert {(k, "object", False) for k in names} <= events, "the bucket copy is announced once uploaded"


@pytest.mark.slow
def test_uploads_deferred_through_an_outage_all_reach_the_bucket(
    private_s3_server: Any,
    private_s3_store: ObjectStore,
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
) -> None:
    server, store = private_s3_server, private_s3_store
    engine = make_engine(store, cache, metrics, cooldown=0.5)
    agent_metrics = EngineMetrics(CollectorRegistry())
    start_agent(cache, store, agent_metrics, cooldown=0.5)
    before = keys(3, "before")
    engine.store_many([(k, payload(i)) for i, k in enumerate(before)])
    wait_for(lambda: cache.backlog().chunks == 0, what="the first uploads")

    server.stop()
    during = keys(20, "during")
    for i in range(0, 20, 5):  # stores keep coming while the store is gone
        outcome = engine.store_many([(k, payload(10 + i + j)) for j, k in enumerate(during[i : i + 5])])
        assert outcome.written == 5
    wait_for(
        lambda: sample(agent_metrics, "kvstore:object_store_up") == 0, what="the agent's breaker to open"
    )
    # Reads keep working from NVMe while the store is gone.
    assert load(engine, before + during) == [payload(i) for i in range(3)] + [
        payload(10 + i) for i in range(20)
    ]
    assert cache.backlog().chunks == 20

    server.start()
    wait_for(lambda: all(store.exists_many(during)), timeout=60, what="uploads to resume")
    wait_for(lambda: sample(agent_metrics, "kvstore:object_store_up") == 1, what="the breaker to close")
    assert sample(agent_metrics, "kvstore:upload_retries_total") >= 1
    assert sample(agent_metrics, "kvstore:object_store_errors_total", op="put") >= 1
    assert engine.close().not_uploaded == 0
    assert sample(agent_metrics, "kvstore:uploads_lost_total", reason="evicted") == 0


@pytest.mark.slow
def test_what_one_agent_left_in_the_journal_the_next_one_uploads(
    private_s3_server: Any, private_s3_store: ObjectStore, tmp_path: Path, start_agent: StartAgent
) -> None:
    server, store = private_s3_server, private_s3_store
    names = keys(6, "restart")
    server.stop()
    with NVMeCache(tmp_path / "nvme", budget_bytes=10**8) as cache:
        engine = TieredStore(store, cache, threads=EngineThreads(disk_workers=2))
        assert engine.store_many([(k, payload(i)) for i, k in enumerate(names)]).written == 6
        first = start_agent(cache, store, cooldown=0.2)
        assert engine.close().not_uploaded == 6
        first.stop()
    server.start()
    with NVMeCache(tmp_path / "nvme", budget_bytes=10**8) as cache:
        start_agent(cache, store)
        wait_for(lambda: cache.backlog().chunks == 0, timeout=60, what="the next agent's uploads")
    assert all(store.exists_many(names))


def test_a_chunk_evicted_before_its_upload_is_counted(
    tmp_path: Path, metrics: EngineMetrics, make_engine: MakeEngine
) -> None:
    """No agent keeps up (none runs): the engine's own commits evict to stay in the budget, and each chunk
    that leaves before its upload is counted; the rest are uploaded once an agent comes."""
    store = MemoryStore()
    with NVMeCache(tmp_path / "nvme", budget_bytes=4 * (CHUNK + HEADER_BLOCK)) as cache:
        engine = make_engine(store, cache, metrics)
        names = keys(10, "evicted")
        for i, name in enumerate(names):
            assert engine.store_many([(name, payload(i))]).written == 1
        lost = sample(metrics, "kvstore:uploads_lost_total", reason="evicted")
        assert lost == 6
        assert sample(metrics, "kvstore:nvme_evictions_total") == 6
        agent = NodeAgent(cache, store, metrics=EngineMetrics(CollectorRegistry()), threads=EngineThreads())
        agent.start()
        try:
            wait_for(lambda: cache.backlog().chunks == 0, what="the uploads of what is left")
        finally:
            agent.stop()
    uploaded = sum(store.exists_many(names))
    assert uploaded + lost == 10, "every chunk is either uploaded or counted as lost"


def test_a_damaged_queued_chunk_is_never_uploaded(
    s3_store: ObjectStore,
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
) -> None:
    """The bucket is shared: bytes that fail their check on NVMe never reach it."""
    engine = make_engine(s3_store, cache, metrics)
    names = keys(2, "damaged")
    engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
    located = locate(cache, names[0])
    assert located is not None
    with open(located.path, "r+b") as f:
        f.seek(HEADER_BLOCK + 100)
        f.write(b"\xff\xfe")
    agent_metrics = EngineMetrics(CollectorRegistry())
    start_agent(cache, s3_store, agent_metrics)
    wait_for(lambda: cache.backlog().chunks == 0, what="the journal to be worked off")
    assert s3_store.exists_many(names) == [False, True]
    assert not cache.contains_many(names[:1])[0], "the damaged copy is discarded"
    assert sample(agent_metrics, "kvstore:checksum_failures_total", tier="nvme") == 1


def test_object_hits_are_admitted_by_the_agent(
    s3_store: ObjectStore,
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
) -> None:
    names = keys(5, "admit")
    fill(s3_store, names)
    engine = make_engine(s3_store, cache, metrics)
    agent = start_agent(cache, s3_store)
    assert load(engine, names[:3]) == [payload(i) for i in range(3)]
    engine.housekeeping()
    wait_for(lambda: all(cache.contains_many(names[:3])), what="the admission of the hits")
    assert cache.contains_many(names[3:]) == [False, False], "only what was served is admitted"
    assert cache.backlog().chunks == 0, "admitted hits are not uploaded again"
    assert agent.hints_received >= 1
    engine.housekeeping()
    assert engine.lookup(names[:3]) == [Presence.LOCAL] * 3


def test_the_agent_keeps_the_cache_below_its_budget(
    tmp_path: Path, metrics: EngineMetrics, make_engine: MakeEngine, start_agent: StartAgent
) -> None:
    budget = 20 * (CHUNK + HEADER_BLOCK)
    with NVMeCache(tmp_path / "nvme", budget_bytes=budget) as cache:
        engine = make_engine(None, cache, metrics)  # no store: nothing waits for upload
        agent_metrics = EngineMetrics(CollectorRegistry())
        start_agent(cache, None, agent_metrics)
        names = keys(20, "budget")
        engine.store_many([(k, payload(i)) for i, k in enumerate(names)])  # the whole budget: over 95%
        # The agent counts its evictions just after it commits them: wait for both, not the cache alone.
        wait_for(
            lambda: (
                cache.used_bytes() <= 0.9 * budget
                and sample(agent_metrics, "kvstore:nvme_evictions_total") >= 1
            ),
            what="the agent to evict to its low watermark and count it",
        )
        assert sample(metrics, "kvstore:nvme_evictions_total") == 0, "the engine's commits evicted nothing"
        gone = [k for k, here in zip(names, cache.contains_many(names), strict=True) if not here]
        assert gone == names[: len(gone)], "least recently used first"
        engine.housekeeping()
        removed = {e.key for e in engine.take_events() if e.removed}
        assert set(gone) <= removed, "the engine announces what the agent evicted"


def test_touches_decide_what_the_agent_evicts(
    tmp_path: Path, metrics: EngineMetrics, make_engine: MakeEngine, start_agent: StartAgent
) -> None:
    """Chunks a load served move to the back of the LRU order; chunks a load missed change nothing."""
    budget = 10 * (CHUNK + HEADER_BLOCK)
    with NVMeCache(tmp_path / "nvme", budget_bytes=budget, touch_flush_interval_s=0) as cache:
        engine = make_engine(None, cache, metrics)
        agent = start_agent(cache, None)
        old = keys(8, "lru")
        engine.store_many([(k, payload(i)) for i, k in enumerate(old)])
        served, missing = old[:4], keys(4, "never-stored")
        assert load(engine, served + missing) == [payload(i) for i in range(4)] + [None] * 4
        received = agent.hints_received
        engine.housekeeping()
        wait_for(lambda: agent.hints_received > received, what="the touches to reach the agent")
        cache.flush()
        engine.store_many([(k, payload(100 + i)) for i, k in enumerate(keys(2, "new"))])  # over 95%
        wait_for(lambda: cache.used_bytes() <= 0.9 * budget, what="the agent's eviction")
        assert all(cache.contains_many(served)), "the chunks just served stay"
        assert not all(cache.contains_many(old[4:])), "the untouched ones go first"
        assert set(cached_keys(cache)).isdisjoint(missing)


def test_access_records_and_counters_reach_the_bucket_and_the_index(
    s3_store: ObjectStore,
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
) -> None:
    engine = make_engine(s3_store, cache, metrics)
    start_agent(cache, s3_store, access_flush_s=0.2)
    names = keys(3, "access")
    engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
    assert load(engine, names) == [payload(i) for i in range(3)]
    engine.close()  # its last figures and hints go to the agent

    def recorded() -> set[str]:
        return {k for _, _, ks in read_access_records(s3_store) for k in ks}

    wait_for(lambda: set(names) <= recorded(), what="access records in the bucket")
    loaded = counter_name("nvme", "read_bytes")
    wait_for(lambda: cache.counters().get(loaded, 0) == 3 * CHUNK, what="the node's counters")


def test_an_index_error_in_the_agents_periodic_work_does_not_stop_it(
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Trimming the change log fails (LMDB reports a full disk as EIO): the agent logs it and goes on
    uploading (before: the error left its loop and the agent stopped)."""
    failures: list[int] = []

    def fail(_keep: int) -> None:
        failures.append(_keep)
        raise CacheError("mdb_txn_commit: Input/output error")

    monkeypatch.setattr(cache, "trim_changes", fail)
    store = MemoryStore()
    engine = make_engine(store, cache, metrics)
    agent = start_agent(cache, store)
    wait_for(lambda: failures, what="the trim to fail")
    names = keys(2, "after-eio")
    assert engine.store_many([(k, payload(i)) for i, k in enumerate(names)]).written == 2
    wait_for(lambda: all(store.exists_many(names)), what="the uploads after the failures")
    assert agent.running


class RefusingStore(MemoryStore):
    """A real in-memory store that refuses one object with an error of its own (as S3 answers a 4xx about
    one request), every time."""

    def __init__(self, refused: str) -> None:
        super().__init__()
        self.refused = refused

    def put(self, key: str, data: bytes | memoryview) -> None:
        if key == self.refused:
            raise StoreError(f"PUT {key!r}: HTTP 400 InvalidRequest")
        super().put(key, data)


class DownStore(MemoryStore):
    """A real in-memory store whose PUTs all fail as a store that is down fails them."""

    def __init__(self) -> None:
        super().__init__()
        self.puts = 0

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.puts += 1
        raise StoreUnavailable(f"PUT {key!r}: connection refused")


def test_upload_retries_count_the_puts_that_failed_not_the_chunks_behind_them(
    cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine, start_agent: StartAgent
) -> None:
    """The first PUT of a round fails and the breaker opens: the chunks behind it wait for the cooldown
    without a PUT, and are not counted as retried (before: all of them were)."""
    store = DownStore()
    engine = make_engine(store, cache, metrics)
    names = keys(6, "behind-a-failure")
    assert engine.store_many([(k, payload(i)) for i, k in enumerate(names)]).written == 6
    agent_metrics = EngineMetrics(CollectorRegistry())
    start_agent(cache, store, agent_metrics, upload_workers=1, cooldown=60.0)
    retries = "kvstore:upload_retries_total"
    wait_for(lambda: sample(agent_metrics, retries) >= 1, what="the first round")
    assert sample(agent_metrics, retries) == store.puts == 1
    assert cache.backlog().chunks == 6


def test_one_chunk_the_store_refuses_never_holds_up_the_rest(
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The oldest chunk in the journal is refused by the store, alone: it waits for a later try, the others
    are uploaded, and the store is never taken for down (before: every round, it opened the node-wide
    breaker, and the journal behind it crawled at a batch per cooldown)."""
    names = keys(24, "behind-a-refused-one")
    store = RefusingStore(names[0])
    engine = make_engine(store, cache, metrics)
    assert engine.store_many([(k, payload(i)) for i, k in enumerate(names)]).written == 24
    agent_metrics = EngineMetrics(CollectorRegistry())
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        start_agent(cache, store, agent_metrics, upload_workers=2)
        wait_for(lambda: all(store.exists_many(names[1:])), what="the uploads of the others")
    assert cache.backlog().chunks == 1, "the refused one waits"
    assert sample(agent_metrics, "kvstore:upload_retries_total") == 1
    assert sample(agent_metrics, "kvstore:object_store_errors_total", op="put") == 1
    assert "refused queued chunk" in caplog.text
    assert "serving from NVMe" not in caplog.text, "the store was never taken for down"


def test_one_agent_per_cache_directory(cache: NVMeCache, start_agent: StartAgent) -> None:
    first = start_agent(cache, None)
    second = NodeAgent(cache, None, metrics=EngineMetrics.for_registry(), threads=EngineThreads())
    with pytest.raises(AgentAlreadyRunning):
        second.start(wait_s=0.2)
    first.stop()
    second.start(wait_s=5)  # the lock went with the first
    second.stop()


@pytest.mark.slow
def test_an_agent_started_for_engines_exits_once_none_is_left(
    cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine, start_agent: StartAgent
) -> None:
    engine = make_engine(None, cache, metrics)
    agent = start_agent(cache, None, exit_when_idle_s=0.5)
    assert not agent.wait(1.5), "an engine still uses the cache"
    engine.close()
    assert agent.wait(10), "no engine left, nothing to upload: the agent exits"
