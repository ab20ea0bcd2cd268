"""Engines never wait on the node agent: a process stopped inside an LMDB write transaction (the index's write
lock held until it dies) costs a store a failure, never vLLM's job thread, and never freezes a process that
opens the cache; a hung agent is reported down and replaced by an engine. Real processes, a real LMDB index.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.cache import NVMeCache
from kvstore.config import Settings
from kvstore.engine import Presence, StoreOutcome, TieredStore
from kvstore.metrics import EngineMetrics
from kvstore.node.agent_files import HUNG_S, STATUS_NAME, agent_status
from kvstore.runtime import Node
from kvstore.stores import MemoryStore
from tests.engine_helpers import keys, load, payload
from tests.helpers import sample, wait_for, wait_value

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Holds the index's write lock: begins a write transaction, then stops itself (SIGSTOP) inside it, as an
# agent stopped or deadlocked mid-transaction does.
_STOPPED_WRITER = """
import os, signal, sys, lmdb
env = lmdb.open(sys.argv[1], max_dbs=32)
txn = env.begin(write=True)
print("in a write transaction", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.fixture
def stopped_writer() -> Iterator[Callable[[NVMeCache], subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(cache: NVMeCache) -> subprocess.Popen[str]:
        index = str(Path(cache.directory) / "index")
        proc = subprocess.Popen(
            [sys.executable, "-c", _STOPPED_WRITER, index], stdout=subprocess.PIPE, text=True
        )
        started.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "in a write transaction"
        wait_for(lambda: _state(proc.pid) == "T", what="the writer to stop inside its transaction")
        return proc

    yield start
    for proc in started:
        proc.kill()  # a stopped process dies of SIGKILL too; the index's robust mutex goes with it
        proc.wait(10)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _chunk_files(cache: NVMeCache) -> int:
    return sum(len(files) for _, _, files in os.walk(Path(cache.directory) / "chunks"))


def test_a_store_never_waits_on_a_process_stopped_inside_an_index_write(
    cache: NVMeCache,
    metrics: EngineMetrics,
    make_engine: Callable[..., TieredStore],
    stopped_writer: Callable[[NVMeCache], subprocess.Popen[str]],
) -> None:
    """The store fails at its deadline and the next fails at once, writing nothing; once the stopped process
    is killed, the late commit lands: its chunks are served right, nothing on disk is unindexed."""
    engine = make_engine(MemoryStore(), cache, metrics, commit_timeout_s=0.5)
    writer = stopped_writer(cache)
    first = keys(4, "while-held")
    results: queue.SimpleQueue[StoreOutcome] = queue.SimpleQueue()
    job = threading.Thread(
        target=lambda: results.put(engine.store_many([(k, payload(i)) for i, k in enumerate(first)]))
    )
    job.start()
    job.join(60)  # a bound on a hang, not a measurement: the deadline is half a second
    assert not job.is_alive(), "vLLM's job thread waited on the index's write lock"
    outcome = results.get_nowait()
    assert (outcome.written, outcome.failed) == (0, 4)
    files = _chunk_files(cache)
    again = engine.store_many([(k, payload(10 + i)) for i, k in enumerate(keys(4, "later"))])
    assert (again.written, again.failed) == (0, 4), "fails at once while a commit is that late"
    assert _chunk_files(cache) == files, "and writes no file that could not be committed"
    assert sample(metrics, "kvstore:stores_dropped_total", reason="index_busy") == 8

    writer.kill()
    writer.wait(10)
    after = keys(1, "after")
    wait_for(
        lambda: engine.store_many([(after[0], payload(20))]).written == 1,
        what="stores to work again once the lock is free",
    )
    # The first commit had begun waiting for the lock: it landed late, and its chunks are served.
    assert load(engine, first + after) == [*(payload(i) for i in range(4)), payload(20)]
    assert {e.key for e in engine.take_events() if not e.removed} >= set(first), "announced late"
    report = cache.fsck(verify_checksums=True)
    assert report.orphan_files == () and report.missing_files == () and report.bad_checksums == ()
    assert cache.backlog().chunks == 5, "all of them wait for upload"


_OPENER = """
import sys, threading, time
from kvstore.cache import NVMeCache

def say(line):
    sys.stdout.write(line + "\\n")  # one write a line: the two threads' lines never interleave
    sys.stdout.flush()

def tick():
    while True:
        say("tick")
        time.sleep(0.05)

say("opening")
threading.Thread(target=tick, daemon=True).start()
NVMeCache(sys.argv[1], 1 << 30).close()
say("opened")
"""


def test_opening_the_cache_beside_a_stopped_writer_never_freezes_the_process(
    cache: NVMeCache, stopped_writer: Callable[[NVMeCache], subprocess.Popen[str]]
) -> None:
    """Opening the index waits for its write lock (to open its tables) with the GIL released: the process's
    other threads go on. py-lmdb's own open held the GIL, freezing e.g. vLLM's whole process."""
    writer = stopped_writer(cache)
    opener = subprocess.Popen(
        [sys.executable, "-c", _OPENER, cache.directory], stdout=subprocess.PIPE, text=True
    )
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    reader = threading.Thread(
        target=lambda: [lines.put(line.strip()) for line in opener.stdout or ()], daemon=True
    )
    reader.start()
    try:
        deadline = time.monotonic() + 120  # a bound on a slow start (imports on a busy machine)
        while _next(lines, timeout=1.0) != "opening":
            assert time.monotonic() < deadline and opener.poll() is None, "the opener never began"
        ticks = 0
        deadline = time.monotonic() + 120  # a bound on a freeze: 60 ticks take 3 s
        while ticks < 60 and time.monotonic() < deadline:
            line = _next(lines, timeout=1.0)
            assert line != "opened", "it cannot open while the lock is held"
            ticks += line == "tick"
        assert ticks >= 60, "the opener's other thread stopped: the open held the GIL"
        writer.kill()
        writer.wait(10)
        wait_for(lambda: _next(lines) == "opened", timeout=60, what="the open, once the lock is free")
    finally:
        opener.kill()
        opener.wait(10)


def _next(lines: queue.SimpleQueue[str], timeout: float = 0.2) -> str | None:
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        return None


def test_an_engine_reports_a_hung_agent_down_and_replaces_it(
    settings: Settings, open_engine_node: Callable[..., Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spawned agent that stops answering (SIGSTOP: not runnable) and has not beaten for HUNG_S is hung:
    the engine's `agent_up` is 0, the engine kills it and starts another, which uploads what is stored.
    Engines once saw only that the lock was held: `agent_up` 1, and nothing uploaded for good."""
    monkeypatch.setattr("kvstore.node.watch.RESTART_EVERY_S", 5.0)  # a restart 5 s after the first start
    node = open_engine_node("spawn")
    hung = wait_value(lambda: agent_status(settings.cache_dir).pid, what="the agent the engine started")
    os.kill(hung, signal.SIGSTOP)
    past = time.time() - HUNG_S - 10
    os.utime(Path(settings.cache_dir) / STATUS_NAME, (past, past))  # no heartbeat for longer than HUNG_S

    seen_down = threading.Event()

    def replaced() -> bool:
        node.engine.housekeeping()  # the engine looks every few seconds
        if sample(node.engine.metrics, "kvstore:agent_up") == 0:
            seen_down.set()
        status = agent_status(settings.cache_dir)
        return status.running and status.pid != hung and not status.hung

    wait_for(replaced, timeout=90, what="the engine to replace the hung agent")
    assert seen_down.is_set(), "agent_up was 0 while the agent was hung"
    wait_for(lambda: not Path(f"/proc/{hung}").exists() or _state(hung) == "Z", what="the hung one to die")
    names = keys(6, "after-hang")
    assert node.engine.store_many([(k, payload(i)) for i, k in enumerate(names)]).written == 6
    wait_for(lambda: all(node.store.exists_many(names)), timeout=60, what="the new agent's uploads")
    wait_for(
        lambda: node.engine.housekeeping() or sample(node.engine.metrics, "kvstore:agent_up") == 1,
        what="the engine to see the new agent",
    )
    assert node.engine.lookup(names) == [Presence.LOCAL] * 6
