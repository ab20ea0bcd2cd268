from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cache import CachedChunk, CacheUsage, NVMeCache, ReadStatus
from kvstore.chunk import HEADER_BLOCK, stored_size
from kvstore.errors import CacheError, ConfigError

U = stored_size(100)  # what one small test chunk takes on disk: a header block and one payload block


def k(i: int) -> str:
    return f"llama_abc123def456_r0/abc/de_g0/{i:064x}.bin"


def blob(i: int, size: int = 100) -> bytes:
    return bytes([i % 251]) * size


# -- opening


@pytest.mark.parametrize("budget", [0, -1])
def test_bad_budget_names_the_setting(cache_dir: Path, budget: int) -> None:
    with pytest.raises(ConfigError, match="cache_bytes"):
        NVMeCache(cache_dir, budget)


def test_uncreatable_directory_is_a_cache_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    with pytest.raises(CacheError, match="a-file") as info:
        NVMeCache(blocker / "cache", 1000)
    assert "not usable" in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_read_only_directory_is_a_cache_error(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(CacheError, match="ro"):
            NVMeCache(ro, 1000)
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("bad", ["", "x" * 501, "é" * 300])
def test_bad_keys_are_rejected(cache: NVMeCache, bad: str) -> None:
    with pytest.raises(CacheError, match="key"):
        cache.put(bad, b"x")
    with pytest.raises(CacheError):
        cache.contains(bad)


def test_non_str_key_is_rejected(cache: NVMeCache) -> None:
    with pytest.raises(CacheError):
        cache.get(b"bytes-key")  # type: ignore[arg-type]


# -- put / get / locate


def test_put_get_roundtrip(cache: NVMeCache) -> None:
    assert cache.get(k(1)) is None
    assert cache.put(k(1), blob(1))
    assert cache.get(k(1)) == blob(1)
    assert cache.contains(k(1))
    assert not cache.put(k(1), blob(1)), "already present"
    assert cache.put(k(2), memoryview(blob(2, 50)))
    assert cache.get(k(2)) == blob(2, 50)
    assert cache.usage() == CacheUsage(used_bytes=2 * U, budget_bytes=10 * U, entries=2, pinned_entries=0)


def test_put_many_admits_a_batch_in_one_go(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 3 * U + 100) as cache:
        cache.put(k(0), blob(0))
        # Already cached, fresh, a duplicate within the batch, too big for the budget, fresh again.
        items = [(k(0), blob(0)), (k(1), blob(1)), (k(1), blob(1)), (k(2), blob(2, 4 * U)), (k(3), blob(3))]
        assert cache.put_many(items) == [False, True, False, False, True]
        assert [cache.get(k(i)) for i in (0, 1, 3)] == [blob(0), blob(1), blob(3)]
        assert cache.usage().used_bytes == 3 * U
        # A batch larger than the budget: later entries evict the oldest, earlier ones of the batch included.
        assert cache.put_many([(k(i), blob(i)) for i in range(10, 15)]) == [True] * 5
        assert sorted(cache.take_evicted()) == sorted([k(0), k(1), k(3), k(10), k(11)])
        assert [cache.contains(k(i)) for i in range(10, 15)] == [False, False, True, True, True]
        assert cache.usage().used_bytes == 3 * U
        # No file is left behind for anything that is not indexed.
        files = {str(f) for f in (cache_dir / "chunks").rglob("*") if f.is_file()}
        assert files == {c.path for c in cache.locate_many([k(i) for i in range(12, 15)]) if c}


def test_empty_blob(cache: NVMeCache) -> None:
    assert cache.put(k(1), b"")
    assert cache.get(k(1)) == b""


def test_blob_larger_than_budget_is_not_admitted(cache: NVMeCache) -> None:
    assert not cache.put(k(1), b"x" * (10 * U - HEADER_BLOCK + 1))
    assert cache.put(k(1), b"x" * (10 * U - HEADER_BLOCK))
    assert cache.usage().used_bytes == 10 * U
    assert not list(Path(cache.directory).rglob("*.tmp")), "nothing written for the refused one"


def test_locate(cache: NVMeCache) -> None:
    assert cache.locate(k(1)) is None
    cache.put(k(1), blob(1))
    loc = cache.locate(k(1))
    assert isinstance(loc, CachedChunk)
    assert (loc.key, loc.size, loc.raw_length) == (k(1), U, 100)
    data = Path(loc.path).read_bytes()
    assert len(data) == U and data[HEADER_BLOCK : HEADER_BLOCK + 100] == blob(1)
    assert Path(loc.path).is_relative_to(cache.directory)


def test_locate_many_matches_locate(cache: NVMeCache) -> None:
    for i in (1, 3):
        cache.put(k(i), blob(i))
    keys = [k(i) for i in range(4)]
    assert cache.locate_many(keys) == [cache.locate(key, touch=False) for key in keys]
    assert [c is not None for c in cache.locate_many(keys)] == [False, True, False, True]


def test_contains_many(cache: NVMeCache) -> None:
    cache.put(k(1), blob(1))
    cache.put(k(3), blob(3))
    assert cache.contains_many([k(i) for i in range(5)]) == [False, True, False, True, False]
    assert cache.contains_many([]) == []
    assert cache.contains_many(k(1)) == [True]  # a bare str is one key


def test_keys_iterates_everything(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10**9) as cache:
        for i in range(2500):  # more than one internal batch
            cache.put(k(i), b"x")
        assert sorted(cache.keys()) == sorted(k(i) for i in range(2500))


def test_vanished_file_is_a_miss_and_drops_the_entry(cache: NVMeCache) -> None:
    for i in (1, 2):
        cache.put(k(i), blob(i))
        loc = cache.locate(k(i))
        assert loc is not None
        os.unlink(loc.path)
    assert cache.get(k(1)) is None
    # locate() does not stat (load hot path); the reader that finds the file gone reports it.
    loc = cache.locate(k(2))
    assert loc is not None
    cache.forget(k(2), loc.path)
    assert cache.locate(k(2)) is None
    assert not cache.contains(k(1)) and not cache.contains(k(2))
    assert cache.usage().used_bytes == 0
    assert sorted(cache.take_evicted()) == [k(1), k(2)]


def test_torn_file_is_a_miss(cache: NVMeCache) -> None:
    cache.put(k(1), blob(1))
    loc = cache.locate(k(1))
    assert loc is not None
    Path(loc.path).write_bytes(b"short")
    assert cache.get(k(1)) is None
    assert not os.path.exists(loc.path)
    assert cache.take_evicted() == [k(1)]


def test_discard(cache: NVMeCache) -> None:
    cache.put(k(1), blob(1))
    path = cache.locate(k(1))
    assert path is not None
    assert cache.discard(k(1))
    assert not cache.discard(k(1))
    assert not os.path.exists(path.path)
    assert cache.get(k(1)) is None
    assert cache.usage().used_bytes == 0
    assert cache.take_evicted() == [], "the caller asked for it"


def test_readmission_uses_a_fresh_file_name(cache: NVMeCache) -> None:
    cache.put(k(1), blob(1))
    first = cache.locate(k(1))
    cache.discard(k(1))
    cache.put(k(1), blob(1))
    second = cache.locate(k(1))
    assert first is not None and second is not None and first.path != second.path


def test_fsync_setting(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10 * U, fsync=True) as cache:
        assert cache.put(k(1), blob(1))
        assert cache.get(k(1)) == blob(1)


# -- eviction


def test_lru_eviction_respects_touches(cache_dir: Path) -> None:
    seen: list[list[str]] = []
    with NVMeCache(cache_dir, 3 * U, on_evict=seen.append) as cache:
        for i in range(3):
            cache.put(k(i), blob(i))
        cache.touch([k(0)])  # k(1) is now the least recently used
        assert cache.put(k(3), blob(3))
        assert cache.contains_many([k(0), k(1), k(2), k(3)]) == [True, False, True, True]
        cache.get(k(2))  # a read is a touch too
        assert cache.put(k(4), blob(4))
        assert cache.contains_many([k(0), k(2), k(3), k(4)]) == [False, True, True, True]
        assert cache.take_evicted() == [k(1), k(0)]
        assert cache.take_evicted() == []
        assert seen == [[k(1)], [k(0)]]
        assert cache.usage().used_bytes == 3 * U


def test_eviction_frees_as_many_as_needed(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10 * U) as cache:
        for i in range(10):
            cache.put(k(i), blob(i))
        big = b"y" * (4 * U - HEADER_BLOCK)  # takes four units
        assert cache.put(k(99), big)
        assert cache.take_evicted() == [k(0), k(1), k(2), k(3)]
        assert cache.usage() == CacheUsage(10 * U, 10 * U, 7, 0)


def test_failing_on_evict_does_not_break_put(cache_dir: Path) -> None:
    def boom(keys: list[str]) -> None:
        raise RuntimeError("observer bug")

    with NVMeCache(cache_dir, U, on_evict=boom) as cache:
        assert cache.put(k(1), blob(1))
        assert cache.put(k(2), blob(2))
        assert cache.take_evicted() == [k(1)]


def test_touch_is_buffered_until_flush(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 3 * U, touch_flush_interval_s=3600) as writer:
        for i in range(3):
            writer.put(k(i), blob(i))
        with NVMeCache(cache_dir, 3 * U) as other:  # same env through the registry
            other.touch([k(0)])
            other.flush()
        assert writer.put(k(3), blob(3))
        assert writer.take_evicted() == [k(1)]


def test_touch_of_unknown_key_is_harmless(cache: NVMeCache) -> None:
    cache.touch([k(7), k(8)])
    cache.flush()
    assert cache.usage().entries == 0


# -- pins


def test_pins_count_and_protect(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 3 * U) as cache:
        cache.pin([k(0)])  # before it is cached
        cache.pin([k(0)])
        assert cache.pinned(k(0)) == 2
        for i in range(3):
            cache.put(k(i), blob(i))
        assert cache.usage().pinned_entries == 1
        for i in range(3, 8):
            assert cache.put(k(i), blob(i))
        assert cache.contains(k(0))
        cache.unpin([k(0)])
        assert cache.pinned(k(0)) == 1
        assert cache.put(k(8), blob(8)) and cache.contains(k(0))
        cache.unpin(k(0))  # a bare str is one key
        assert cache.pinned(k(0)) == 0
        cache.unpin([k(0)])  # never below zero
        assert cache.pinned(k(0)) == 0
        cache.touch([k(6), k(7), k(8)])
        assert cache.put(k(9), blob(9))
        assert not cache.contains(k(0)), "unpinned and least recently used"


def test_put_fails_when_everything_else_is_pinned(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 3 * U) as cache:
        for i in range(3):
            cache.put(k(i), blob(i))
        cache.pin([k(0), k(1)])
        assert not cache.put(k(3), b"z" * (2 * U - HEADER_BLOCK))
        assert cache.put(k(3), blob(3))  # k(2) can go
        cache.pin([k(3)])
        assert not cache.put(k(4), blob(4))
        assert cache.usage() == CacheUsage(3 * U, 3 * U, 3, 3)
        assert sorted(cache.keys()) == [k(0), k(1), k(3)]
        files = [p for p in Path(cache_dir, "chunks").rglob("*") if p.is_file()]
        assert len(files) == 3, "rejected admissions leave no files"


# -- lifecycle


def test_reopen_keeps_contents(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10 * U) as cache:
        cache.put(k(1), blob(1))
        cache.pin([k(1)])
    with NVMeCache(cache_dir, 10 * U) as cache:
        assert cache.get(k(1)) == blob(1)
        assert cache.pinned(k(1)) == 1


def test_two_instances_in_one_process_share_the_index(cache_dir: Path) -> None:
    a = NVMeCache(cache_dir, 10 * U)
    b = NVMeCache(cache_dir, 10 * U)
    a.put(k(1), blob(1))
    assert b.get(k(1)) == blob(1)
    a.close()
    a.close()  # idempotent
    assert b.get(k(1)) == blob(1)
    b.close()
    with pytest.raises(CacheError, match="closed"):
        b.get(k(1))


def test_contains_many_over_a_large_index(cache_dir: Path) -> None:
    """Exactly the indexed keys, in order, over one snapshot of 20,000 entries. (Its speed, ~2 us/key, is
    `kvstore bench tiers`' to measure: a wall-clock bound here only fails on a busy machine.)"""
    n = 20_000
    with NVMeCache(cache_dir, 10**9, index_sync=False) as cache:
        _bulk_fill(cache, n)
        keys = [k(i) for i in range(0, 2 * n, 2)]  # half hits, half misses
        assert cache.contains_many(keys) == [i < n for i in range(0, 2 * n, 2)]
        assert cache.contains_many([]) == []


def _bulk_fill(cache: NVMeCache, n: int) -> None:
    """Index entries without files, in one transaction (only contains_many is exercised)."""
    from kvstore.cache.index import _lru_key
    from kvstore.cache.records import Entry

    s = cache._index._db()
    with s.env.begin(write=True) as txn:
        for i in range(n):
            key = k(i).encode()
            txn.put(key, Entry(1, b"\0" * 16, i, b"\0" * 8).pack(), db=s.entries)
            txn.put(_lru_key(i, key), b"", db=s.lru)


def test_forked_child_keeps_working(cache: NVMeCache) -> None:
    cache.put(k(1), blob(1))
    pid = os.fork()
    if pid == 0:  # child: keeps working through the inherited handle (see kvstore.cache.index)
        ok = cache.get(k(1)) == blob(1) and cache.put(k(2), blob(2))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert cache.get(k(2)) == blob(2)
    assert cache.fsck().clean


# -- direct I/O: straight between the device and the caller's buffer, no page-cache copy


def _resident_pages(path: str) -> int:
    """Pages of the file in the page cache (mincore over a private mapping of it)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(v & 1 for v in vec)
    finally:
        mapped.close()


def _fs_type(path: Path) -> str:
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        mount, fs = line.split()[1:3]
        if str(path.resolve()).startswith(mount) and len(mount) > len(best):
            best, kind = mount, fs
    return kind


def test_chunks_bypass_the_page_cache_where_the_filesystem_allows(cache_dir: Path) -> None:
    import mmap

    if _fs_type(cache_dir.parent) not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"{_fs_type(cache_dir.parent)} may refuse O_DIRECT")
    raw = os.urandom(256 * 1024)
    with NVMeCache(cache_dir, 10**8) as cache:
        assert cache.direct_io
        assert cache.put(k(1), raw)
        loc = cache.locate(k(1))
        assert loc is not None
        assert _resident_pages(loc.path) == 0, "a written chunk left pages in the page cache"
        dest = mmap.mmap(-1, len(raw))  # page-aligned, like vLLM's primary region
        assert cache.read_into(loc, memoryview(dest)).ok
        assert dest[:] == raw
        assert _resident_pages(loc.path) == 0, "a read chunk left pages in the page cache"


@pytest.fixture
def no_direct_io_dir(tmp_path: Path) -> Iterator[Path]:
    """A ramfs mount: a real filesystem that refuses O_DIRECT (tmpfs accepts it since Linux 6.6)."""
    import subprocess

    mount = tmp_path / "ramfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {done.stderr.strip()}")
    try:
        yield mount / "cache"
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_o_direct_falls_back_to_buffered_io_where_refused(
    no_direct_io_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"), NVMeCache(no_direct_io_dir, 10**8) as cache:
        assert not cache.direct_io  # probed once at open
        assert "refuses O_DIRECT" in caplog.text
        raw = os.urandom(100_000)
        assert cache.put(k(1), raw)
        loc = cache.locate(k(1))
        assert loc is not None
        out = bytearray(len(raw))
        assert cache.read_into(loc, memoryview(out)).ok and bytes(out) == raw
        assert cache.get(k(1)) == raw
        assert cache.fsck().clean
        assert not list(no_direct_io_dir.rglob("*.tmp")), "the probe leaves nothing behind"


def test_direct_io_can_be_turned_off(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10**8, direct_io=False) as cache:
        assert not cache.direct_io
        assert cache.put(k(1), b"buffered") and cache.get(k(1)) == b"buffered"


@pytest.mark.parametrize("size", [100, 4096, 256 * 1024 + 3])
def test_read_into_any_buffer(cache: NVMeCache, size: int) -> None:
    import mmap

    raw = os.urandom(size)
    with NVMeCache(cache.directory, 10**8) as big:
        assert big.put(k(1), raw)
        loc = big.locate(k(1))
        assert loc is not None
        aligned = mmap.mmap(-1, size)
        unaligned = memoryview(bytearray(size + 1))[1:]
        for dest in (memoryview(aligned), unaligned):
            assert big.read_into(loc, dest).ok
            assert bytes(dest) == raw


def test_read_into_reports_what_it_found_and_changes_nothing(cache: NVMeCache) -> None:
    for i in (1, 2, 3, 4):
        cache.put(k(i), blob(i))
    out = memoryview(bytearray(100))
    located = {i: cache.locate(k(i)) for i in (1, 2, 3, 4)}
    assert all(located.values())
    one, two, three, four = (located[i] for i in (1, 2, 3, 4))
    assert one is not None and two is not None and three is not None and four is not None
    # A valid chunk copied over another key's file: the index's key-bound checksum catches it.
    Path(two.path).write_bytes(Path(one.path).read_bytes())
    assert cache.read_into(two, out).status is ReadStatus.CORRUPT
    os.truncate(three.path, HEADER_BLOCK + 10)
    assert cache.read_into(three, out).status is ReadStatus.CORRUPT
    os.unlink(four.path)
    assert cache.read_into(four, out).status is ReadStatus.GONE
    assert cache.read_into(one, memoryview(bytearray(99))).status is ReadStatus.UNREADABLE
    assert cache.read_into(one, out).ok and bytes(out) == blob(1)
    assert all(cache.contains(k(i)) for i in (1, 2, 3, 4)), "read_into removes nothing"


def test_the_upload_journal_survives_a_restart(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10 * U) as cache:
        assert cache.put_many([(k(i), blob(i)) for i in range(3)], pending_upload=True) == [True] * 3
        claimed = cache.claim_uploads(1)
        assert [c.key for c in claimed] == [k(0)] and claimed[0].pending_upload
        cache.finish_uploads([k(0)])
    with NVMeCache(cache_dir, 10 * U) as cache:  # reopened: what was not uploaded is still queued
        assert cache.backlog().chunks == 2
        assert sorted(c.key for c in cache.claim_uploads(10)) == [k(1), k(2)]
        located = cache.locate(k(1))
        assert located is not None and len(cache.read_stored(located)) == U


def test_eviction_takes_uploaded_chunks_first_and_counts_the_others(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 2 * U) as cache:
        cache.put(k(0), blob(0), pending_upload=True)  # the oldest, and its only copy
        cache.put(k(1), blob(1))
        cache.put(k(2), blob(2))
        assert cache.contains_many([k(0), k(1)]) == [True, False], "the uploaded chunk goes first"
        cache.put(k(3), blob(3), pending_upload=True)
        assert cache.contains_many([k(0), k(2)]) == [True, False]
        assert cache.take_lost_uploads() == {}
        cache.put(k(4), blob(4), pending_upload=True)  # nothing uploaded is left: the oldest goes
        assert not cache.contains(k(0))
        assert cache.take_lost_uploads() == {"evicted": 1}
        assert cache.take_lost_uploads() == {}
        assert cache.backlog().chunks == 2
