"""Deferred index flushes (`kvstore.cache.index_flush`): commits flushed together, a marker per process while
any may be unflushed, and an index a machine crash may have damaged rebuilt from the chunk files at open."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cache_workers import blob_for, key_for

from kvstore.cache import NVMeCache, index_flush, lmdb_env
from kvstore.cache.fsck import REBUILD_LOCK
from kvstore.cache.index import CacheIndex
from kvstore.cache.index_flush import leave_marker
from kvstore.errors import IndexSuspect
from migrations.runner import migrate
from tests.cache_helpers import admit, read_chunk

OTHER_BOOT = "0123456789abcdef" * 2


def markers(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in (cache_dir / "index").glob("unflushed.*"))


def rebuilt(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("index.damaged-*"))


def fill(cache_dir: Path, n: int) -> None:
    with NVMeCache(cache_dir, 10**6) as cache:
        for i in range(n):
            assert admit(cache, key_for(i), blob_for(key_for(i)))


def test_commits_are_flushed_within_the_interval_and_a_clean_close_leaves_no_marker(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10**6, index_flush_s=0.05) as cache:
        shared = lmdb_env.REGISTRY[os.path.realpath(cache_dir / "index")]
        assert shared.flusher is not None and not shared.env.flags()["sync"]
        [marker] = markers(cache_dir)
        assert marker.startswith(f"unflushed.{index_flush.boot_id()}.{os.getpid()}.")
        assert admit(cache, key_for(1), blob_for(key_for(1)))
        last = shared.env.info()["last_txnid"]
        deadline = time.monotonic() + 10
        while shared.flusher.flushed_txnid < last and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shared.flusher.flushed_txnid >= last
    assert markers(cache_dir) == []


def test_syncing_each_commit_leaves_no_marker(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10**6, index_flush_s=0) as cache:
        shared = lmdb_env.REGISTRY[os.path.realpath(cache_dir / "index")]
        assert shared.flusher is None and shared.env.flags()["sync"]
        assert admit(cache, key_for(1), blob_for(key_for(1)))
        assert markers(cache_dir) == []


_DIES_WITH_THE_CACHE_OPEN = """
import sys
from cache_workers import blob_for, key_for
from kvstore.cache import NVMeCache
from tests.cache_helpers import admit
cache = NVMeCache(sys.argv[1], 10**6)
admit(cache, key_for(7), blob_for(key_for(7)))
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_killed_process_leaves_its_marker_and_the_next_open_flushes_and_removes_it(cache_dir: Path) -> None:
    """Its commits are in the page cache: the machine did not stop, so nothing is rebuilt."""
    child = subprocess.Popen(
        [sys.executable, "-c", _DIES_WITH_THE_CACHE_OPEN, str(cache_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == b"ready"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    child.stdout.close()
    child.stdin.close()
    assert [m for m in markers(cache_dir) if f".{child.pid}." in m], markers(cache_dir)

    with NVMeCache(cache_dir, 10**6) as cache:
        assert not [m for m in markers(cache_dir) if f".{child.pid}." in m]
        assert read_chunk(cache, key_for(7)) == blob_for(key_for(7))
    assert rebuilt(cache_dir) == []


def test_a_marker_of_another_boot_rebuilds_the_index_from_the_chunk_files(cache_dir: Path) -> None:
    fill(cache_dir, 5)
    leave_marker(str(cache_dir / "index"), OTHER_BOOT)  # what a process open when the machine stopped left
    os.truncate(cache_dir / "index" / "data.mdb", 8192)  # and pages it never wrote
    assert index_flush.suspect(str(cache_dir / "index"))
    assert migrate(cache_dir=cache_dir) == []  # a suspect index is never read, not even to migrate it
    with pytest.raises(IndexSuspect):  # nor by an opener that syncs each of its own commits
        CacheIndex(cache_dir, flush_s=0)

    with NVMeCache(cache_dir, 10**6) as cache:
        aside = rebuilt(cache_dir)
        assert len(aside) == 1 and [m for m in os.listdir(aside[0]) if OTHER_BOOT in m]
        assert not [m for m in markers(cache_dir) if OTHER_BOOT in m]
        for i in range(5):
            assert read_chunk(cache, key_for(i)) == blob_for(key_for(i))
        assert cache.fsck().clean
        # Whether a chunk had been uploaded was in the suspect index: every one is queued again.
        assert cache.backlog().chunks == 5


_OPENS = """
import sys
from kvstore.cache import NVMeCache
with NVMeCache(sys.argv[1], 10**6) as cache:
    print(cache.usage().entries, flush=True)
"""


def test_processes_that_find_the_index_suspect_together_rebuild_it_once(cache_dir: Path) -> None:
    fill(cache_dir, 5)
    leave_marker(str(cache_dir / "index"), OTHER_BOOT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _OPENS, str(cache_dir)], stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(3)
    ]
    outputs = [child.communicate(timeout=120)[0] for child in children]
    assert [child.returncode for child in children] == [0, 0, 0]
    assert [out.strip() for out in outputs] == ["5", "5", "5"], "each saw the whole rebuilt index"
    assert len(rebuilt(cache_dir)) == 1


def test_an_open_waits_while_the_index_is_being_rebuilt(cache_dir: Path) -> None:
    """A rebuild holds the directory's lock exclusively: an open that went ahead would see half an index."""
    fill(cache_dir, 5)
    fd = os.open(cache_dir / REBUILD_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as `open_recovering` holds it while it rebuilds
        child = subprocess.Popen(
            [sys.executable, "-c", _OPENS, str(cache_dir)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        time.sleep(3.0)  # ample for it to start and open, were it not waiting
        assert child.poll() is None, "it opened the index during the rebuild"
    finally:
        os.close(fd)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and out.strip() == "5"
