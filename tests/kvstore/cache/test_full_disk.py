"""A cache on a disk far smaller than its budget: a real 8 MiB tmpfs under ``cache_bytes`` = 50 GiB. The
cache keeps to the free space, warns at start, and a full disk makes it evict, never stop caching."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvstore.agent.node_agent import NodeAgent
from kvstore.cache import NVMeCache, StagedFile
from kvstore.chunk import encode
from kvstore.engine import EngineThreads, TieredStore
from kvstore.errors import CacheFull
from kvstore.metrics import EngineMetrics
from tests.cache_helpers import read_chunk
from tests.engine_helpers import keys, load, payload
from tests.helpers import wait_for

DISK_MIB = 8
CHUNK = 256 * 1024
BATCHES = 60  # store jobs of 1 to 4 chunks, each written before one commit: 150 chunks, 37.5 MiB


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    done = _run("mount", "-t", "tmpfs", "-o", f"size={DISK_MIB}m", "tmpfs", str(mount))
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a {DISK_MIB} MiB tmpfs here, and a full disk needs a real one: {done.stderr}"
        )
    try:
        yield mount
    finally:
        if _run("umount", str(mount)).returncode != 0:
            _run("umount", "-l", str(mount))


def _space(path: Path) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _key(i: int) -> str:
    return f"llama_abc123def456_r0/abc/de_g0/{i:064x}.bin"


def test_a_disk_smaller_than_the_budget_keeps_caching(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = small_disk / "cache"
    with caplog.at_level(logging.WARNING, logger="kvstore.cache"), NVMeCache(directory, 50 << 30) as cache:
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("cache_bytes" in m and str(directory) in m for m in warned), "a start-up warning"
        free, total = _space(directory)
        assert total <= DISK_MIB << 20
        budget = cache.effective_budget()
        assert 0 < budget < free, "an empty cache may take the free space, less a reserve"
        assert cache.effective_budget(written_bytes=CHUNK) == budget + CHUNK

        full = 0
        admitted = 0
        for batch in range(BATCHES):
            keys = [_key(batch * 4 + j) for j in range(1 + batch % 4)]
            raws = [os.urandom(CHUNK) for _ in keys]
            staged: list[StagedFile] = []
            for key, raw in zip(keys, raws, strict=True):
                chunk = encode(key, raw)
                try:
                    staged.append(cache.write_file(chunk.header, chunk.parts()))
                except CacheFull:
                    full += 1
                    cache.make_room(chunk.header.total_length)  # what kvstore.engine.writes does
                    staged.append(cache.write_file(chunk.header, chunk.parts()))
            assert cache.commit(staged) == [True] * len(keys), f"batch {batch}"
            admitted += len(keys)
            free, _ = _space(directory)
            used = cache.used_bytes()
            assert used + free <= total, "usage stays within the filesystem"
            # A commit evicts down to what the filesystem has room for (a reserve left free for the index and
            # everything else), not only to cache_bytes.
            assert used <= cache.effective_budget() <= used + free
            assert [read_chunk(cache, key) for key in keys] == raws, "the newest chunks read back whole"

        assert admitted == 150
        # A chunk bigger than the room the reserve leaves (another model's larger blocks on the same node):
        # the disk is full though the cache is within its effective budget, and make_room must evict for it.
        for i in range(4):
            key, raw = _key(1000 + i), os.urandom(4 * CHUNK)
            chunk = encode(key, raw)
            assert _space(directory)[0] < chunk.header.total_length
            with pytest.raises(CacheFull):
                cache.write_file(chunk.header, chunk.parts())
            assert len(cache.make_room(chunk.header.total_length)) >= 4
            assert cache.commit([cache.write_file(chunk.header, chunk.parts())]) == [True]
            assert read_chunk(cache, key) == raw
        free, _ = _space(directory)
        assert cache.used_bytes() + free <= total
        assert full > 0, "the disk filled up: the way out of CacheFull was taken"
        assert cache.effective_budget() < total
        assert cache.fsck().clean
        assert not list(directory.rglob("*.tmp")), "no write cut short by the full disk left a file"


def _fill_disk(mount: Path) -> Path:
    """Another file takes every byte left on the disk (growing, if it is there already)."""
    hog = mount / "hog"
    fd = os.open(hog, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    block = b"\0" * (64 << 10)
    try:
        while True:
            try:
                os.write(fd, block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(block) == 4096:
                    return hog
                block = block[: len(block) // 2]  # the last few pages
    finally:
        os.close(fd)


def test_a_disk_another_file_filled_recovers(small_disk: Path) -> None:
    """Another file fills the disk to the last byte: stores become misses instead of raising, the cache still
    opens, its agent starts and evicts, and once the other file goes the node caches again (before: "not
    usable: No space left on device", and eviction failed at LMDB's commit, for good)."""
    directory = small_disk / "cache"
    with NVMeCache(directory, 50 << 30) as cache:
        engine = TieredStore(None, cache, threads=EngineThreads(disk_workers=2))  # no store: no uploads
        before = keys(40, "before")
        for first in range(0, 40, 8):
            batch = before[first : first + 8]
            assert engine.store_many([(k, payload(first + i)) for i, k in enumerate(batch)]).written == 8
        hog = _fill_disk(small_disk)
        assert _space(small_disk)[0] < 4096
        during = keys(8, "during")
        outcome = engine.store_many([(k, payload(100 + i)) for i, k in enumerate(during)])
        assert outcome.written + outcome.failed == 8, "misses or stores, never an exception"

        # The stores' own evictions gave room back; the other file takes it. With the disk full the cache is
        # over its budget (what it holds plus the free space, less a reserve), so the agent must evict.
        _fill_disk(small_disk)
        assert _space(small_disk)[0] < 4096
        NVMeCache(directory, 50 << 30).close()  # another process's open (its own probe) works
        agent = NodeAgent(
            cache,
            None,
            metrics=EngineMetrics(CollectorRegistry()),
            threads=EngineThreads(),
            pin_sync_s=0,
            idle_priority=False,
        )
        agent.start()  # its status file needs a page, which the cache's ballast gave back
        try:
            wait_for(
                lambda: cache.used_bytes() <= 0.9 * cache.effective_budget() and _space(small_disk)[0] > 0,
                what="the agent to evict down to what the other file leaves",
            )
            assert agent.running
        finally:
            agent.stop()

        hog.unlink()
        after = keys(8, "after")
        assert engine.store_many([(k, payload(200 + i)) for i, k in enumerate(after)]).written == 8
        assert load(engine, after) == [payload(200 + i) for i in range(8)]
        engine.close()
        assert cache.fsck().clean


def test_the_agent_evicts_to_the_free_space_not_to_cache_bytes(small_disk: Path) -> None:
    """On a disk smaller than `cache_bytes`, the agent keeps the cache between 90 and 95% of what the disk
    has room for, so the engines' stores find room without evicting in their own commits."""
    directory = small_disk / "cache"
    with NVMeCache(directory, 50 << 30) as cache:
        engine = TieredStore(None, cache, threads=EngineThreads(disk_workers=2))
        names = keys(200, "fill")
        for i, name in enumerate(names):  # until the cache holds more than 95% of what it may
            engine.store_many([(name, payload(i))])
            if cache.used_bytes() > 0.96 * cache.effective_budget():
                break
        assert cache.used_bytes() > 0.95 * cache.effective_budget()
        agent = NodeAgent(
            cache,
            None,
            metrics=EngineMetrics(CollectorRegistry()),
            threads=EngineThreads(),
            pin_sync_s=0,
            idle_priority=False,
        )
        agent.start()
        try:
            wait_for(
                lambda: cache.used_bytes() <= 0.9 * cache.effective_budget(),
                what="the agent to evict to 90% of the room the disk has",
            )
        finally:
            agent.stop()
            engine.close()


def test_an_agent_whose_evictions_cannot_commit_keeps_running(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another file takes the ballast's room too: no eviction can commit. The agent says so and tries again
    (before: the eviction's error ended the agent); once room returns it evicts."""
    directory = small_disk / "cache"
    with NVMeCache(directory, 50 << 30) as cache:
        engine = TieredStore(None, cache, threads=EngineThreads(disk_workers=2))
        for first in range(0, 40, 8):
            batch = keys(40, "full")[first : first + 8]
            engine.store_many([(k, payload(first + i)) for i, k in enumerate(batch)])
        agent = NodeAgent(
            cache,
            None,
            metrics=EngineMetrics(CollectorRegistry()),
            threads=EngineThreads(),
            pin_sync_s=0,
            idle_priority=False,
        )
        agent.start()
        try:
            with caplog.at_level(logging.WARNING, logger="kvstore.agent.eviction"):
                hog = _fill_disk(small_disk)
                (directory / "ballast").unlink(missing_ok=True)  # spent already
                more = _fill_disk(small_disk / "cache")
                wait_for(
                    lambda: any("cannot evict" in r.getMessage() for r in caplog.records),
                    what="an eviction that cannot commit",
                )
                assert agent.running
            hog.unlink()
            more.unlink()
            wait_for(
                lambda: cache.used_bytes() <= 0.9 * cache.effective_budget(),
                what="the agent to evict once there is room",
            )
            assert agent.running
        finally:
            agent.stop()
            engine.close()
