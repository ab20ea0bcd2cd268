"""Several processes on one cache directory, and writers SIGKILLed at random points."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from cache_workers import blob_for, key_for, mixed_workload

from kvstore.cache import NVMeCache, ReadStatus
from kvstore.cache.index import CacheIndex
from tests.cache_helpers import read_status

WORKER = Path(__file__).with_name("cache_workers.py")
CRASH_BUDGET = 60 * 8192  # about a quarter of the keys' chunks fit: writers evict all the time
CRASH_KEYS = 300
SHARED_BUDGET = 30 * 8192


pytestmark = pytest.mark.slow


def assert_reads_exact(cache: NVMeCache, n_keys: int, when: str = "") -> None:
    """Every chunk the index holds reads back exactly through the data path (status OK, not merely "a miss
    or the right bytes", which would accept a cache that loses or corrupts chunks); the others are misses."""
    keys = [key_for(i) for i in range(n_keys)]
    held = cache.contains_many(keys)
    for key, present in zip(keys, held, strict=True):
        status, data = read_status(cache, key)
        if present:
            assert status is ReadStatus.OK, f"{when}: {key} is indexed but reads {status}"
            assert data == blob_for(key), f"{when}: {key} is indexed but reads wrong bytes"
        else:
            assert status is None, f"{when}: {key} is not indexed but reads {status}"


def test_two_processes_share_one_cache(cache_dir: Path) -> None:
    NVMeCache(cache_dir, SHARED_BUDGET).close()  # create it before the race to open
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=2, mp_context=ctx) as pool:
        futures = [
            pool.submit(mixed_workload, str(cache_dir), seed, 1500, SHARED_BUDGET, 60) for seed in (1, 2)
        ]
        assert [f.result(timeout=120) for f in futures] == [0, 0], "a process read wrong bytes"
    with NVMeCache(cache_dir, SHARED_BUDGET) as cache:
        report = cache.fsck()
        assert report.clean, report
        assert 0 < cache.usage().used_bytes <= SHARED_BUDGET
        assert any(cache.contains_many([key_for(i) for i in range(60)]))
        assert_reads_exact(cache, 60)


def test_sigkilled_writers_never_corrupt_the_cache(cache_dir: Path) -> None:
    rng = random.Random(1234)
    rounds = 18
    cache = NVMeCache(cache_dir, CRASH_BUDGET)
    seq = cache.change_seq()
    try:
        for round_no in range(rounds):
            child = subprocess.Popen(
                [sys.executable, str(WORKER), str(cache_dir), str(round_no), str(CRASH_BUDGET)],
                stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
            assert child.stdout is not None
            assert child.stdout.readline().strip() == b"ready"
            time.sleep(rng.uniform(0.0, 0.2))
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()

            report = cache.fsck()
            # A crash may only leave orphans (tmp files, files of uncommitted admissions or of evictions
            # committed but not yet unlinked); the index itself is always consistent.
            assert report.missing_files == () and report.bad_checksums == (), report
            assert report.usage_drift == 0 and report.entries_drift == 0 and report.lru_mismatches == 0
            assert cache.usage().used_bytes <= CRASH_BUDGET
            # The change log is written in the transactions that change the entries: a killed writer leaves
            # no gap and no half-written change.
            changes = cache.changes_since(seq, limit=1 << 30)
            assert [c.seq for c in changes] == list(range(seq, seq + len(changes)))
            assert cache.change_seq() == seq + len(changes)
            seq += len(changes)
            assert_reads_exact(cache, CRASH_KEYS, f"round {round_no}")
            cache.fsck(fix=True)
            assert cache.fsck().clean
    finally:
        cache.close()


_COMMITTER = """
import sys
from kvstore.cache.index import CacheIndex
index = CacheIndex(sys.argv[1], flush_s=60.0)  # no fsync: commits back to back, a kill often lands in one
print("ready", flush=True)
while True:
    index.add_counters({"commits": 1})
"""


def test_catch_up_publishes_the_last_commit_of_a_killed_writer(cache_dir: Path) -> None:
    """LMDB publishes a commit to readers after writing it: a writer killed in between leaves its last
    commit unseen until the next writer takes the write lock. fsck calls ``catch_up`` first so it never
    takes that commit's files for orphans (a repair deleted one that way, and its entry showed a moment
    later, naming nothing). A kill lands in the window about one time in ten here, so this kills 60."""
    rng = random.Random(7)
    index = CacheIndex(cache_dir)
    try:
        for round_no in range(60):
            child = subprocess.Popen(
                [sys.executable, "-c", _COMMITTER, str(cache_dir)],
                stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
            assert child.stdout is not None
            assert child.stdout.readline().strip() == b"ready"
            time.sleep(rng.uniform(0.001, 0.02))
            child.kill()
            child.wait()
            child.stdout.close()

            index.catch_up()
            seen = index.read_counters()
            index.add_counters({"other": 1})  # the next writer: whatever it publishes, catch_up did already
            assert index.read_counters().get("commits") == seen.get("commits"), f"round {round_no}"
    finally:
        index.close()


def test_leftovers_of_killed_writers_are_reclaimed_at_open(cache_dir: Path) -> None:
    """A writer killed mid-write leaves a tmp file that counts against no budget: the next open removes it,
    and leaves the tmp files of writers that are still alive."""
    NVMeCache(cache_dir, CRASH_BUDGET).close()
    child = subprocess.Popen(
        [sys.executable, str(WORKER), str(cache_dir), "7", str(CRASH_BUDGET)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == b"ready"
    time.sleep(0.3)
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    folder = next((cache_dir / "chunks").iterdir())
    planted = folder / f".{child.pid}.{'a' * 32}.{'0' * 16}.tmp"  # what a write cut short leaves
    planted.write_bytes(b"x" * 8192)
    alive = folder / f".{os.getpid()}.{'b' * 32}.{'1' * 16}.tmp"  # a live writer's, in flight
    alive.write_bytes(b"y" * 8192)
    assert any((cache_dir / "writers").iterdir()), "the killed writer's marker is left behind"
    with NVMeCache(cache_dir, CRASH_BUDGET) as reopened:
        assert not planted.exists() and alive.exists()
        leftovers = [f for f in (cache_dir / "chunks").rglob("*.tmp") if f != alive]
        assert leftovers == []
        assert reopened.fsck(orphan_min_age_s=60).clean  # the live writer's file is young
    alive.unlink()
    assert not list((cache_dir / "writers").iterdir()), "closed writers leave no marker"


def test_files_of_an_eviction_cut_short_are_deleted_at_the_next_open(cache_dir: Path) -> None:
    """The eviction's commit dropped the entries; the process died before it deleted one file. The next open
    deletes them all, reading the short list the commit wrote (not scanning the cache)."""
    child = subprocess.run(
        [sys.executable, str(WORKER), "evict-and-die", str(cache_dir), "200"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL
    files = [f for f in (cache_dir / "chunks").rglob("*") if f.is_file()]
    assert len(files) == 200, "the eviction committed and deleted nothing"
    with NVMeCache(cache_dir, CRASH_BUDGET) as cache:
        assert cache.usage().entries == 0
        assert not [f for f in files if f.exists()], "the next open deleted the evicted chunks' files"
        report = cache.fsck()
        assert report.clean and report.files == 0, report
    with NVMeCache(cache_dir, CRASH_BUDGET) as cache:
        assert cache._index.pending_unlinks() == [], "a healthy cache leaves nothing for the next open to do"
