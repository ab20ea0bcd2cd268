"""The upload journal's claims and losses across processes that die: a killed uploader's claims are taken
over at once, claims ignore the wall clock, and every chunk an engine stored is either in the bucket or
counted lost, once, for the whole node."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvstore.agent.node_agent import NodeAgent
from kvstore.agent.uploads import wait_uploaded_in
from kvstore.cache import NVMeCache
from kvstore.chunk import HEADER_BLOCK
from kvstore.engine import TieredStore
from kvstore.engine.node_counters import counter_name
from kvstore.metrics import EngineMetrics
from kvstore.stores import MemoryStore
from tests.engine_helpers import CHUNK, keys, payload
from tests.helpers import sample, wait_for

MakeEngine = Callable[..., TieredStore]
StartAgent = Callable[..., NodeAgent]

# An uploader in a process of its own: claims what it is told for two minutes, says so, and waits to be
# killed (an agent killed mid-upload).
_CLAIMER = """
import sys, time
from kvstore.cache import NVMeCache
with NVMeCache(sys.argv[1], 1 << 40) as cache:
    claimed = cache.claim_uploads(int(sys.argv[2]), lease_s=120)
    print(" ".join(c.key for c in claimed), flush=True)
    time.sleep(600)
"""


@pytest.fixture
def claimer() -> Iterator[Callable[[Path, int], tuple[subprocess.Popen[str], list[str]]]]:
    started: list[subprocess.Popen[str]] = []

    def start(directory: Path, n: int) -> tuple[subprocess.Popen[str], list[str]]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CLAIMER, str(directory), str(n)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        started.append(proc)
        assert proc.stdout is not None
        return proc, proc.stdout.readline().split()

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_killed_uploaders_claims_are_taken_over_at_once(
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    claimer: Callable[[Path, int], tuple[subprocess.Popen[str], list[str]]],
) -> None:
    """A claim lasts two minutes so that a slow upload is not done twice; one whose holder was killed is
    taken over at once, as GC's lease is (before: the chunks waited out the two minutes)."""
    engine = make_engine(MemoryStore(), cache, metrics)  # no agent runs: the chunks wait in the journal
    names = keys(6, "claimed")
    assert engine.store_many([(k, payload(i)) for i, k in enumerate(names)]).written == 6
    proc, held = claimer(Path(cache.directory), 4)
    assert held == names[:4]
    assert [c.key for c in cache.claim_uploads(10, lease_s=120)] == names[4:], "a live holder's claims hold"
    kill(proc)
    assert [c.key for c in cache.claim_uploads(10, lease_s=120)] == names[:4], "a dead holder's are free"


def test_claims_are_judged_by_the_boot_clock_not_the_wall_clock(
    cache: NVMeCache, metrics: EngineMetrics, make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim made while the wall clock ran an hour ahead (then stepped back) still lasts its lease (before:
    an hour and its lease)."""
    engine = make_engine(MemoryStore(), cache, metrics)
    names = keys(3, "clock")
    assert engine.store_many([(k, payload(i)) for i, k in enumerate(names)]).written == 3
    real = time.time_ns
    with monkeypatch.context() as clock:
        clock.setattr(time, "time_ns", lambda: real() + 3600 * 10**9)
        assert [c.key for c in cache.claim_uploads(10, lease_s=0.3)] == names
    assert cache.claim_uploads(10, lease_s=0.3) == [], "held for its lease"
    wait_for(lambda: cache.claim_uploads(10, lease_s=60), timeout=10, what="the claims to expire after 0.3 s")


written = counter_name("nvme", "write_bytes")


def lost_in(metrics: EngineMetrics) -> float:
    reasons = ("evicted", "discarded", "fsck", "lost")
    return sum(sample(metrics, "kvstore:uploads_lost_total", reason=r) for r in reasons)


def test_every_stored_chunk_is_uploaded_or_counted_lost_once_for_the_node(
    tmp_path: Path,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
    claimer: Callable[[Path, int], tuple[subprocess.Popen[str], list[str]]],
) -> None:
    """An agent killed while it held chunks that the engines' commits then evicted, and a next agent: every
    chunk an engine stored is in the bucket or in the node's lost count, and each process's own count adds
    up to the node's (before: killed agents' chunks were in neither, and the counts disagreed)."""
    store = MemoryStore()
    with NVMeCache(tmp_path / "nvme", budget_bytes=6 * (CHUNK + HEADER_BLOCK)) as cache:
        engine = make_engine(store, cache, metrics)
        names = keys(16, "fate")

        def stored(first: int, last: int) -> None:
            for i in range(first, last):
                assert engine.store_many([(names[i], payload(i))]).written == 1

        stored(0, 4)
        proc, held = claimer(tmp_path / "nvme", 2)  # an agent mid-upload of the two oldest
        assert held == names[:2]
        stored(4, 10)  # over the budget: the oldest go, the two it holds among them (their upload may finish)
        assert not any(cache.contains_many(names[:2]))
        kill(proc)  # it never finishes them
        stored(10, 16)
        agent_metrics = EngineMetrics(CollectorRegistry())
        start_agent(cache, store, agent_metrics)
        wait_for(lambda: cache.backlog().chunks == 0, what="the next agent's uploads")
        uploaded = sum(store.exists_many(names))
        wait_for(
            lambda: cache.counters().get("uploads_lost", 0) + uploaded == 16,
            what="every chunk uploaded or counted lost",
        )
        lost = cache.counters()["uploads_lost"]
        assert lost == 10 and uploaded == 6
        engine.housekeeping()
        wait_for(lambda: lost_in(metrics) + lost_in(agent_metrics) == lost, what="the processes' own counts")
        engine.publish_counters()  # the engine's figures for the node's counters, through the agent
        wait_for(lambda: cache.counters().get(written, 0) > 0, what="the engine's figures to reach the index")
        assert cache.counters()["uploads_lost"] == lost, "an engine's own count is not added a second time"


def test_a_queued_chunk_that_cannot_be_read_now_waits_and_is_never_discarded(
    tmp_path: Path,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading queued chunks' files fails for a while (too many open files, a disk error): that proves
    nothing about the chunks, their only copies, which wait and are uploaded once reads work (before: the
    agent discarded them as corrupt, counted lost)."""
    store = MemoryStore()
    with NVMeCache(tmp_path / "nvme", budget_bytes=1 << 30) as cache:
        engine = make_engine(store, cache, metrics)
        names = keys(3, "unreadable-now")
        assert engine.store_many([(k, payload(i)) for i, k in enumerate(names)]).written == 3
        files = cache._files
        readable = files.read_whole

        def fails(path: str, size: int) -> memoryview:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(files, "read_whole", fails)
        agent_metrics = EngineMetrics(CollectorRegistry())
        start_agent(cache, store, agent_metrics)
        retries = "kvstore:upload_retries_total"
        wait_for(lambda: sample(agent_metrics, retries) >= 3, what="a round that could not read")
        assert cache.contains_many(names) == [True] * 3
        monkeypatch.setattr(files, "read_whole", readable)
        wait_for(lambda: cache.backlog().chunks == 0, what="the uploads once reads work")
        assert all(store.exists_many(names))
        assert cache.counters().get("uploads_lost", 0) == 0
        assert sample(agent_metrics, "kvstore:checksum_failures_total", tier="nvme") == 0


def test_a_driver_waits_for_the_uploads_by_reading_the_index_alone(
    tmp_path: Path,
    metrics: EngineMetrics,
    make_engine: MakeEngine,
    start_agent: StartAgent,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A benchmark's driver waits for a node's uploads while the node's engine and agent run, and leaves the
    cache's files and budget to them (before: it opened the whole cache with a made-up budget and warned,
    once per benchmark point, that the disk was smaller)."""
    store = MemoryStore()
    with NVMeCache(tmp_path / "nvme", budget_bytes=1 << 30) as cache:
        engine = make_engine(store, cache, metrics)
        names = keys(3, "drained")
        assert engine.store_many([(k, payload(i)) for i, k in enumerate(names)]).written == 3
        with caplog.at_level(logging.INFO, logger="kvstore.cache"):
            assert not wait_uploaded_in(tmp_path / "nvme", 0.2)  # no agent runs: the chunks wait
            start_agent(cache, store, EngineMetrics(CollectorRegistry()))
            assert wait_uploaded_in(tmp_path / "nvme", 60)
        assert all(store.exists_many(names))
        assert not caplog.records, "the driver touched the cache beyond its index"
