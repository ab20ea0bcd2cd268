"""NVMeCache through the entry points the product uses: ``write_file`` + ``commit`` to admit, ``read_into`` to
load, ``locate_many``/``contains_many`` to look up, the change log for what left the cache."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.cache import CachedChunk, CacheUsage, Change, ChangeKind, NVMeCache, ReadStatus
from kvstore.chunk import (
    _HEADER_CHECKSUM_AT,
    _KEY_AT,
    FORMAT_VERSION,
    HEADER_BLOCK,
    Codec,
    _header_checksum,
    encode,
    parse_header,
    stored_size,
    verify,
)
from kvstore.errors import CacheError, ChunkUnreadable, ConfigError
from tests.cache_helpers import (
    admit,
    admit_many,
    cached_keys,
    evicted_since,
    locate,
    read_chunk,
    read_status,
)

U = stored_size(100)  # what one small test chunk takes on disk: a header block and one payload block


def k(i: int) -> str:
    return f"llama_abc123def456_r0/abc/de_g0/{i:064x}.bin"


def blob(i: int, size: int = 100) -> bytes:
    return bytes([i % 251]) * size


def chunk_files(cache_dir: Path) -> list[Path]:
    return [p for p in (cache_dir / "chunks").rglob("*") if p.is_file()]


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


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[Path]:
    """`tmp_path/ro` bind-mounted read-only over itself: read-only for root too. It holds an empty folder and
    a cache created before the remount (a cache whose filesystem went read-only)."""
    ro = tmp_path / "ro"
    (ro / "empty").mkdir(parents=True)
    NVMeCache(ro / "cache", 1000).close()
    done = _run("mount", "--bind", str(ro), str(ro))
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({done.stderr.strip()})")
    try:
        done = _run("mount", "-o", "remount,bind,ro", str(ro))
        if done.returncode != 0:
            pytest.skip(f"cannot remount a bind mount read-only here ({done.stderr.strip()})")
        yield ro
    finally:
        if _run("umount", str(ro)).returncode != 0:
            _run("umount", "-l", str(ro))


def test_read_only_directory_is_a_cache_error(read_only_mount: Path) -> None:
    for directory in (read_only_mount / "empty", read_only_mount / "cache"):
        with pytest.raises(CacheError, match="not usable") as info:
            NVMeCache(directory, 1000)
        assert directory.name in str(info.value)


_OPEN_AS_NOBODY = """
import sys
from kvstore.cache import NVMeCache
from kvstore.errors import CacheError
NVMeCache(sys.argv[1], 1000).close()  # a folder this user may write: the cache opens
try:
    NVMeCache(sys.argv[2], 1000)
except CacheError as exc:
    print("CacheError:", exc)
else:
    print("opened")
"""


def test_read_only_directory_is_a_cache_error_for_an_unprivileged_user() -> None:
    """The same check through permissions, not a mount: as the test's own user where that is not root (a
    folder it may not write), else in a child run as `nobody` (setpriv)."""
    base = Path(tempfile.mkdtemp(prefix="kvstore-ro-"))
    try:
        base.chmod(0o755)
        writable, ro = base / "rw", base / "ro"
        writable.mkdir()
        ro.mkdir()
        ro.chmod(0o555)
        if os.geteuid() != 0:
            NVMeCache(writable, 1000).close()
            with pytest.raises(CacheError, match="ro"):
                NVMeCache(ro, 1000)
            return
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", sys.executable]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and setpriv is not installed: no unprivileged user to run as")
        probe = subprocess.run(
            [*nobody, "-c", "import kvstore.cache"], capture_output=True, text=True, env=env
        )
        if probe.returncode != 0:
            pytest.skip(f"`nobody` cannot run this Python or import kvstore: {probe.stderr.strip()[-300:]}")
        os.chown(writable, 65534, 65534)
        done = subprocess.run(
            [*nobody, "-c", _OPEN_AS_NOBODY, str(writable), str(ro)],
            capture_output=True,
            text=True,
            env=env,
            cwd=base,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("CacheError:") and "not usable" in done.stdout, done.stdout
        assert str(ro) in done.stdout
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- keys


@pytest.mark.parametrize("bad", ["", "x" * 501, "é" * 300])
def test_bad_keys_are_rejected(cache: NVMeCache, bad: str) -> None:
    calls: dict[str, Callable[[], object]] = {
        "contains_many": lambda: cache.contains_many([bad]),
        "locate_many": lambda: cache.locate_many([bad]),
        "discard": lambda: cache.discard(bad),
        "forget": lambda: cache.forget(bad, "/nowhere"),
        "pin": lambda: cache.pin([bad]),
        "pinned": lambda: cache.pinned(bad),
    }
    for name, call in calls.items():
        with pytest.raises(CacheError, match="key"):
            call()
            pytest.fail(f"{name} accepted {bad[:8]!r}...")


@pytest.mark.parametrize("bad", ["x" * 501, "é" * 300])
def test_overlong_keys_are_not_admitted(cache: NVMeCache, bad: str) -> None:
    """Keys the chunk format takes (up to 2048 bytes) but the index cannot (500)."""
    with pytest.raises(CacheError, match="key"):
        admit(cache, bad, b"x")
    assert cache.usage().entries == 0


def test_a_refused_commit_leaves_no_files(cache_dir: Path, cache: NVMeCache) -> None:
    with pytest.raises(CacheError, match="key"):
        admit_many(cache, [(k(1), blob(1)), ("x" * 501, b"x")])
    assert chunk_files(cache_dir) == []


def test_a_touch_of_a_bad_key_does_not_break_the_next_commit(cache: NVMeCache) -> None:
    with contextlib.suppress(CacheError):  # refusing the key at once is fine too
        cache.touch([""])
    assert admit(cache, k(1), blob(1))


def test_a_cache_directory_removed_underneath_fails_as_a_cache_error(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10 * U) as cache:
        chunk = encode(k(1), blob(1))
        staged = cache.write_file(chunk.header, chunk.parts())
        shutil.rmtree(cache_dir)  # an operator cleared the disk under a running engine
        with pytest.raises(CacheError):
            cache.commit([staged])
        assert cache.make_room(U) == [], "nothing evicted, nothing raised: the write that needed room fails"


def test_non_str_key_is_rejected(cache: NVMeCache) -> None:
    with pytest.raises(CacheError):
        cache.contains_many([b"bytes-key"])  # type: ignore[list-item]
    with pytest.raises(CacheError):
        cache.locate_many([b"bytes-key"])  # type: ignore[list-item]


# -- admit / read / locate


def test_admit_read_roundtrip(cache: NVMeCache) -> None:
    assert read_status(cache, k(1)) == (None, None)
    assert admit(cache, k(1), blob(1))
    assert read_status(cache, k(1)) == (ReadStatus.OK, blob(1))
    assert cache.contains_many([k(1)]) == [True]
    assert not admit(cache, k(1), blob(1)), "already present"
    assert admit(cache, k(2), memoryview(blob(2, 50)))
    assert read_chunk(cache, k(2)) == blob(2, 50)
    assert cache.usage() == CacheUsage(used_bytes=2 * U, budget_bytes=10 * U, entries=2, pinned_entries=0)
    assert len(chunk_files(Path(cache.directory))) == 2, "the refused duplicate left no file"


def test_a_batch_is_admitted_in_one_commit(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 3 * U + 100) as cache:
        admit(cache, k(0), blob(0))
        seq = cache.change_seq()
        # Already cached, fresh, a duplicate within the batch, too big for the budget, fresh again.
        items = [(k(0), blob(0)), (k(1), blob(1)), (k(1), blob(1)), (k(2), blob(2, 4 * U)), (k(3), blob(3))]
        assert admit_many(cache, items) == [False, True, False, False, True]
        assert [read_chunk(cache, k(i)) for i in (0, 1, 3)] == [blob(0), blob(1), blob(3)]
        assert cache.usage().used_bytes == 3 * U
        assert cache.change_seq() == seq, "nothing left the cache"
        # A batch larger than the budget: later entries evict the oldest, earlier ones of the batch included.
        assert admit_many(cache, [(k(i), blob(i)) for i in range(10, 15)]) == [True] * 5
        assert sorted(evicted_since(cache, seq)) == sorted([k(0), k(1), k(3), k(10), k(11)])
        assert cache.contains_many([k(i) for i in range(10, 15)]) == [False, False, True, True, True]
        assert cache.usage().used_bytes == 3 * U
        # No file is left behind for anything that is not indexed.
        files = {str(f) for f in chunk_files(cache_dir)}
        assert files == {c.path for c in cache.locate_many([k(i) for i in range(12, 15)]) if c}


def test_empty_blob(cache: NVMeCache) -> None:
    assert admit(cache, k(1), b"")
    assert read_status(cache, k(1)) == (ReadStatus.OK, b"")


def test_blob_larger_than_budget_is_not_admitted(cache: NVMeCache) -> None:
    assert not admit(cache, k(1), b"x" * (10 * U - HEADER_BLOCK + 1))
    assert not list(Path(cache.directory).rglob("*.tmp")), "nothing written for the refused one"
    assert chunk_files(Path(cache.directory)) == []
    assert admit(cache, k(1), b"x" * (10 * U - HEADER_BLOCK))
    assert cache.usage().used_bytes == 10 * U


def test_locate(cache: NVMeCache) -> None:
    assert locate(cache, k(1)) is None
    admit(cache, k(1), blob(1))
    loc = locate(cache, k(1))
    assert isinstance(loc, CachedChunk)
    assert (loc.key, loc.size, loc.raw_length, loc.codec, loc.pending_upload) == (k(1), U, 100, 0, False)
    data = Path(loc.path).read_bytes()
    assert len(data) == U and data[HEADER_BLOCK : HEADER_BLOCK + 100] == blob(1)
    assert Path(loc.path).is_relative_to(cache.directory)
    assert loc.checksum == parse_header(data, k(1)).checksum


def test_locate_many_answers_each_key_in_order(cache: NVMeCache) -> None:
    for i in (1, 3):
        admit(cache, k(i), blob(i), pending_upload=i == 3)
    keys = [k(i) for i in (3, 0, 1, 2, 3)]
    located = cache.locate_many(keys)
    assert [None if c is None else c.key for c in located] == [k(3), None, k(1), None, k(3)]
    one, three = located[2], located[0]
    assert one is not None and three is not None
    assert one.path != three.path and three.pending_upload and not one.pending_upload
    assert cache.locate_many([]) == []


def test_contains_many(cache: NVMeCache) -> None:
    admit(cache, k(1), blob(1))
    admit(cache, k(3), blob(3))
    assert cache.contains_many([k(i) for i in range(5)]) == [False, True, False, True, False]
    assert cache.contains_many([]) == []
    assert cache.contains_many(k(1)) == [True]  # a bare str is one key


def test_the_index_lists_every_entry(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10**9) as cache:
        for start in range(0, 2500, 500):  # more than one internal batch of the index's listing
            assert all(admit_many(cache, [(k(i), b"x") for i in range(start, start + 500)]))
        assert sorted(cached_keys(cache)) == sorted(k(i) for i in range(2500))
        assert cache.fsck(verify_checksums=False).entries == 2500


def test_vanished_file_is_gone_and_forget_drops_the_entry(cache: NVMeCache) -> None:
    seq = cache.change_seq()
    for i in (1, 2):
        admit(cache, k(i), blob(i))
        loc = locate(cache, k(i))
        assert loc is not None
        os.unlink(loc.path)
    # Looking up does not stat (the load hot path); the reader that finds the file gone reports it.
    assert read_status(cache, k(1)) == (ReadStatus.GONE, None)
    assert cache.contains_many([k(1), k(2)]) == [True, True], "a read changes nothing"
    for i in (1, 2):
        loc = locate(cache, k(i))
        assert loc is not None
        cache.forget(k(i), loc.path)
    assert cache.contains_many([k(1), k(2)]) == [False, False]
    assert cache.usage().used_bytes == 0
    assert [(c.kind, c.key) for c in cache.changes_since(seq)] == [
        (ChangeKind.REMOVED, k(1)),
        (ChangeKind.REMOVED, k(2)),
    ]


def test_forget_spares_a_newer_admission_of_the_key(cache: NVMeCache) -> None:
    admit(cache, k(1), blob(1))
    old = locate(cache, k(1))
    assert old is not None
    cache.discard(k(1))
    admit(cache, k(1), blob(1))  # another process re-admitted it meanwhile
    seq = cache.change_seq()
    cache.forget(k(1), old.path)  # a reader that found the old file gone
    assert read_chunk(cache, k(1)) == blob(1)
    assert cache.change_seq() == seq


def test_torn_file_is_corrupt_and_discard_removes_it(cache: NVMeCache) -> None:
    admit(cache, k(1), blob(1))
    loc = locate(cache, k(1))
    assert loc is not None
    Path(loc.path).write_bytes(b"short")
    seq = cache.change_seq()
    assert read_status(cache, k(1)) == (ReadStatus.CORRUPT, None)
    assert os.path.exists(loc.path) and cache.contains_many([k(1)]) == [True], "a read changes nothing"
    assert cache.change_seq() == seq
    assert cache.discard(k(1))  # what the engine does with a corrupt copy
    assert not os.path.exists(loc.path)
    assert evicted_since(cache, seq) == [k(1)]


def test_discard(cache: NVMeCache) -> None:
    admit(cache, k(1), blob(1))
    path = locate(cache, k(1))
    assert path is not None
    seq = cache.change_seq()
    assert cache.discard(k(1))
    assert not cache.discard(k(1))
    assert not os.path.exists(path.path)
    assert read_status(cache, k(1)) == (None, None)
    assert cache.usage().used_bytes == 0
    assert cache.changes_since(seq) == [Change(seq, ChangeKind.REMOVED, k(1))], "logged once"


def test_readmission_uses_a_fresh_file_name(cache: NVMeCache) -> None:
    admit(cache, k(1), blob(1))
    first = locate(cache, k(1))
    cache.discard(k(1))
    admit(cache, k(1), blob(1))
    second = locate(cache, k(1))
    assert first is not None and second is not None and first.path != second.path


def test_fsync_setting(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10 * U, fsync=True) as cache:
        assert admit(cache, k(1), blob(1))
        assert read_chunk(cache, k(1)) == blob(1)


# -- eviction by admission (`evict` itself: test_evict.py)


def test_lru_eviction_respects_touches(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 3 * U) as cache:
        seq = cache.change_seq()
        for i in range(3):
            admit(cache, k(i), blob(i))
        cache.touch([k(0)])  # k(1) is now the least recently used
        assert admit(cache, k(3), blob(3))
        assert cache.contains_many([k(0), k(1), k(2), k(3)]) == [True, False, True, True]
        # A load is not a touch (read_into changes nothing): the engine touches what it loaded.
        assert read_chunk(cache, k(0)) == blob(0)
        cache.touch([k(2)])
        assert admit(cache, k(4), blob(4))
        assert cache.contains_many([k(0), k(2), k(3), k(4)]) == [False, True, True, True]
        changes = cache.changes_since(seq)
        assert [(c.kind, c.key) for c in changes] == [(ChangeKind.EVICTED, k(1)), (ChangeKind.EVICTED, k(0))]
        assert [c.seq for c in changes] == [seq, seq + 1]
        assert cache.take_removals().evicted == 2
        assert cache.take_removals().evicted == 0
        assert cache.usage().used_bytes == 3 * U


def test_eviction_frees_as_many_as_needed(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10 * U) as cache:
        for i in range(10):
            admit(cache, k(i), blob(i))
        seq = cache.change_seq()
        big = b"y" * (4 * U - HEADER_BLOCK)  # takes four units
        assert admit(cache, k(99), big)
        assert evicted_since(cache, seq) == [k(0), k(1), k(2), k(3)]
        assert cache.usage() == CacheUsage(10 * U, 10 * U, 7, 0)
        assert len(chunk_files(cache_dir)) == 7, "victims' files are unlinked"


def test_touch_is_buffered_until_flush(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 3 * U, touch_flush_interval_s=3600) as writer:
        for i in range(3):
            admit(writer, k(i), blob(i))
        seq = writer.change_seq()
        with NVMeCache(cache_dir, 3 * U) as other:  # same env through the registry
            other.touch([k(0)])
            other.flush()
        assert admit(writer, k(3), blob(3))
        assert evicted_since(writer, seq) == [k(1)]


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
            admit(cache, k(i), blob(i))
        assert cache.usage().pinned_entries == 1
        for i in range(3, 8):
            assert admit(cache, k(i), blob(i))
        assert cache.contains_many([k(0)]) == [True]
        cache.unpin([k(0)])
        assert cache.pinned(k(0)) == 1
        assert admit(cache, k(8), blob(8)) and cache.contains_many([k(0)]) == [True]
        cache.unpin(k(0))  # a bare str is one key
        assert cache.pinned(k(0)) == 0
        cache.unpin([k(0)])  # never below zero
        assert cache.pinned(k(0)) == 0
        cache.touch([k(6), k(7), k(8)])
        assert admit(cache, k(9), blob(9))
        assert cache.contains_many([k(0)]) == [False], "unpinned and least recently used"


def test_admission_fails_when_everything_else_is_pinned(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 3 * U) as cache:
        for i in range(3):
            admit(cache, k(i), blob(i))
        cache.pin([k(0), k(1)])
        seq = cache.change_seq()
        assert not admit(cache, k(3), b"z" * (2 * U - HEADER_BLOCK))
        assert cache.change_seq() == seq, "a refused admission evicts nothing"
        assert admit(cache, k(3), blob(3))  # k(2) can go
        cache.pin([k(3)])
        assert not admit(cache, k(4), blob(4))
        assert cache.usage() == CacheUsage(3 * U, 3 * U, 3, 3)
        assert sorted(cached_keys(cache)) == sorted([k(0), k(1), k(3)])
        assert len(chunk_files(cache_dir)) == 3, "rejected admissions leave no files"


# -- lifecycle


def test_reopen_keeps_contents(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10 * U) as cache:
        admit(cache, k(1), blob(1))
        cache.pin([k(1)])
        cache.discard(k(1))
        admit(cache, k(1), blob(1))
        seq = cache.change_seq()
    with NVMeCache(cache_dir, 10 * U) as cache:
        assert read_chunk(cache, k(1)) == blob(1)
        assert cache.pinned(k(1)) == 1
        assert cache.change_seq() == seq, "the change log persists"


def test_two_instances_in_one_process_share_the_index(cache_dir: Path) -> None:
    a = NVMeCache(cache_dir, 10 * U)
    b = NVMeCache(cache_dir, 10 * U)
    admit(a, k(1), blob(1))
    assert read_chunk(b, k(1)) == blob(1)
    a.close()
    a.close()  # idempotent
    assert read_chunk(b, k(1)) == blob(1)
    b.close()
    b.close()
    with pytest.raises(CacheError, match="closed"):
        b.contains_many([k(1)])
    with pytest.raises(CacheError, match="closed"):
        b.locate_many([k(1)])


def test_contains_many_over_a_large_index(cache_dir: Path) -> None:
    """Exactly the indexed keys, in order, over one snapshot of 20,000 entries. (Its speed, ~2 us/key, is
    `kvstore bench tiers`' to measure: a wall-clock bound here only fails on a busy machine.)"""
    n = 20_000
    with NVMeCache(cache_dir, 10**9, index_flush_s=60.0) as cache:
        _bulk_fill(cache, n)
        keys = [k(i) for i in range(0, 2 * n, 2)]  # half hits, half misses
        assert cache.contains_many(keys) == [i < n for i in range(0, 2 * n, 2)]
        assert cache.contains_many([]) == []


def _bulk_fill(cache: NVMeCache, n: int) -> None:
    """Index entries without files, in one transaction (only contains_many is exercised)."""
    from kvstore.cache.lru import lru_key
    from kvstore.cache.records import Entry

    s = cache._index._db()
    with s.env.begin(write=True) as txn:
        for i in range(n):
            key = k(i).encode()
            txn.put(key, Entry(1, b"\0" * 16, i, b"\0" * 8).pack(), db=s.entries)
            txn.put(lru_key(i, key), b"", db=s.lru)


def test_forked_child_keeps_working(cache: NVMeCache) -> None:
    admit(cache, k(1), blob(1))
    pid = os.fork()
    if pid == 0:  # child: keeps working through the inherited handle (see kvstore.cache.lmdb_env)
        ok = read_chunk(cache, k(1)) == blob(1) and admit(cache, k(2), blob(2))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert read_chunk(cache, k(2)) == blob(2)
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
        assert admit(cache, k(1), raw)
        loc = locate(cache, k(1))
        assert loc is not None
        assert _resident_pages(loc.path) == 0, "a written chunk left pages in the page cache"
        dest = mmap.mmap(-1, len(raw))  # page-aligned, like vLLM's primary region
        assert cache.read_into(loc, memoryview(dest)).ok
        assert dest[:] == raw
        assert _resident_pages(loc.path) == 0, "a read chunk left pages in the page cache"


@pytest.fixture
def no_direct_io_dir(tmp_path: Path) -> Iterator[Path]:
    """A ramfs mount: a real filesystem that refuses O_DIRECT (tmpfs accepts it since Linux 6.6)."""
    mount = tmp_path / "ramfs"
    mount.mkdir()
    done = _run("mount", "-t", "ramfs", "ramfs", str(mount))
    if done.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {done.stderr.strip()}")
    try:
        yield mount / "cache"
    finally:
        _run("umount", "-l", str(mount))


def test_o_direct_falls_back_to_buffered_io_where_refused(
    no_direct_io_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"), NVMeCache(no_direct_io_dir, 10**8) as cache:
        assert not cache.direct_io  # probed once at open
        assert "refuses O_DIRECT" in caplog.text
        raw = os.urandom(100_000)
        assert admit(cache, k(1), raw)
        loc = locate(cache, k(1))
        assert loc is not None
        out = bytearray(len(raw))
        assert cache.read_into(loc, memoryview(out)).ok and bytes(out) == raw
        assert admit_many(cache, [(k(2), raw)], codec=Codec.ZSTD) == [True]
        assert read_chunk(cache, k(2)) == raw
        assert cache.fsck().clean
        assert not list(no_direct_io_dir.rglob("*.tmp")), "the probe leaves nothing behind"


def test_direct_io_can_be_turned_off(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10**8, direct_io=False) as cache:
        assert not cache.direct_io
        assert admit(cache, k(1), b"buffered") and read_chunk(cache, k(1)) == b"buffered"


@pytest.fixture
def staged(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the writes that went through the aligned staging copy (O_DIRECT, a buffer it refuses)."""
    from kvstore.cache import files

    totals: list[int] = []
    real_staged = files.ChunkFiles._staged
    monkeypatch.setattr(
        files.ChunkFiles,
        "_staged",
        lambda self, views, total: totals.append(total) or real_staged(self, views, total),
    )
    return totals


def test_writes_can_go_through_the_page_cache_while_reads_stay_direct(
    cache_dir: Path, staged: list[int]
) -> None:
    raw = os.urandom(64 * 1024 + 5)
    with NVMeCache(cache_dir, 10**8, direct_writes=False) as cache:
        assert cache.direct_io  # reads
        whole = encode(k(1), raw).to_bytes()
        unaligned = memoryview(bytearray(len(whole) + 1))[1:]
        unaligned[:] = whole
        cache.commit([cache.write_file(verify(k(1), unaligned), [unaligned])])
        assert staged == []  # written as it is: no O_DIRECT, no aligned copy
        assert read_chunk(cache, k(1)) == raw


def test_a_whole_chunk_in_one_aligned_buffer_is_written_as_it_is(cache: NVMeCache, staged: list[int]) -> None:
    # A verified GET's body (4 KiB-aligned, as the S3 clients allocate it) goes to disk with no staging copy;
    # an unaligned one is staged. Both read back exact.
    from kvstore.stores.buffers import aligned_buffer

    assert cache.direct_io
    raw = os.urandom(64 * 1024 + 5)
    whole = encode(k(1), raw).to_bytes()
    body = aligned_buffer(len(whole))
    body[:] = whole
    cache.commit([cache.write_file(verify(k(1), body), [body])])
    assert staged == [] and read_chunk(cache, k(1)) == raw
    unaligned = memoryview(bytearray(len(whole) + 1))[1:]
    unaligned[:] = encode(k(2), raw).to_bytes()
    cache.commit([cache.write_file(verify(k(2), unaligned), [unaligned])])
    assert staged == [len(whole)] and read_chunk(cache, k(2)) == raw


@pytest.mark.parametrize("codec", [Codec.NONE, Codec.ZSTD])
@pytest.mark.parametrize("size", [100, 4096, 256 * 1024 + 3])
def test_read_into_any_buffer(cache: NVMeCache, size: int, codec: Codec) -> None:
    import mmap

    raw = os.urandom(size // 2) * 2 + os.urandom(size % 2)  # compressible where zstd is asked for
    with NVMeCache(cache.directory, 10**8) as big:
        assert admit_many(big, [(k(1), raw)], codec=codec) == [True]
        loc = locate(big, k(1))
        assert loc is not None and loc.codec == codec
        aligned = mmap.mmap(-1, size)
        unaligned = memoryview(bytearray(size + 1))[1:]
        for dest in (memoryview(aligned), unaligned):
            assert big.read_into(loc, dest).ok
            assert bytes(dest) == raw


def test_read_into_reports_what_it_found_and_changes_nothing(cache: NVMeCache) -> None:
    for i in (1, 2, 3, 4):
        admit(cache, k(i), blob(i))
    out = memoryview(bytearray(100))
    located = {i: locate(cache, k(i)) for i in (1, 2, 3, 4)}
    one, two, three, four = (located[i] for i in (1, 2, 3, 4))
    assert one is not None and two is not None and three is not None and four is not None
    seq = cache.change_seq()
    # A valid chunk copied over another key's file: the index's key-bound checksum catches it.
    Path(two.path).write_bytes(Path(one.path).read_bytes())
    assert cache.read_into(two, out).status is ReadStatus.CORRUPT
    os.truncate(three.path, HEADER_BLOCK + 10)
    assert cache.read_into(three, out).status is ReadStatus.CORRUPT
    os.unlink(four.path)
    assert cache.read_into(four, out).status is ReadStatus.GONE
    # UNREADABLE is only "another buffer size": the chunk is fine, and left alone.
    assert cache.read_into(one, memoryview(bytearray(99))).status is ReadStatus.UNREADABLE
    assert cache.read_into(one, out).ok and bytes(out) == blob(1)
    assert cache.contains_many([k(i) for i in (1, 2, 3, 4)]) == [True] * 4, "read_into removes nothing"
    assert cache.change_seq() == seq


def _reseal(chunk: bytearray, key: str) -> None:
    """Recompute the header checksum after a header edit: the chunk is valid, in another format."""
    chunk[_HEADER_CHECKSUM_AT:_KEY_AT] = _header_checksum(chunk, len(key.encode()))


@pytest.mark.parametrize("change", ["a newer format version", "an unknown codec"])
def test_a_file_replaced_by_another_format_is_replaced_and_forget_drops_it(
    cache_dir: Path, change: str
) -> None:
    """REPLACED needs a chunk whose header the read parses (compressed: an uncompressed chunk is read
    straight from its payload, so there a replaced file is CORRUPT or, with the same bytes, OK)."""
    raw = bytes(range(256)) * 64
    with NVMeCache(cache_dir, 10**6) as cache:
        assert admit_many(cache, [(k(1), raw), (k(2), raw)], codec=Codec.ZSTD) == [True, True]
        located = locate(cache, k(1))
        assert located is not None and located.codec == Codec.ZSTD
        path = Path(located.path)
        data = bytearray(path.read_bytes())
        if change == "a newer format version":
            data[4] = FORMAT_VERSION + 1
        else:
            data[5] = 9
            path.write_bytes(data)  # the same edit without a valid header checksum: damage
            assert read_status(cache, k(1)) == (ReadStatus.CORRUPT, None)
        _reseal(data, k(1))
        with pytest.raises(ChunkUnreadable):
            parse_header(data, k(1))
        path.write_bytes(data)
        seq = cache.change_seq()
        assert read_status(cache, k(1)) == (ReadStatus.REPLACED, None)
        assert path.exists() and cache.contains_many([k(1)]) == [True], "read_into changes nothing"
        assert cache.change_seq() == seq
        cache.forget(k(1), located.path)  # what the engine does on REPLACED
        assert not path.exists() and cache.contains_many([k(1), k(2)]) == [False, True]
        assert cache.changes_since(seq) == [Change(seq, ChangeKind.REMOVED, k(1))]
        assert read_chunk(cache, k(2)) == raw
        assert cache.fsck().clean


# -- the upload journal


def test_the_upload_journal_survives_a_restart(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10 * U) as cache:
        assert admit_many(cache, [(k(i), blob(i)) for i in range(3)], pending_upload=True) == [True] * 3
        claimed = cache.claim_uploads(1)
        assert [c.key for c in claimed] == [k(0)] and claimed[0].pending_upload
        cache.finish_uploads([k(0)])
    with NVMeCache(cache_dir, 10 * U) as cache:  # reopened: what was not uploaded is still queued
        assert cache.backlog().chunks == 2
        assert sorted(c.key for c in cache.claim_uploads(10)) == [k(1), k(2)]
        located = locate(cache, k(1))
        assert located is not None and len(cache.read_stored(located)) == U
        assert bytes(cache.read_stored(located)) == Path(located.path).read_bytes()


def test_eviction_takes_uploaded_chunks_first_and_counts_the_others(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 2 * U) as cache:
        admit(cache, k(0), blob(0), pending_upload=True)  # the oldest, and its only copy
        admit(cache, k(1), blob(1))
        admit(cache, k(2), blob(2))
        assert cache.contains_many([k(0), k(1)]) == [True, False], "the uploaded chunk goes first"
        admit(cache, k(3), blob(3), pending_upload=True)
        assert cache.contains_many([k(0), k(2)]) == [True, False]
        assert cache.take_removals().lost_uploads == {}
        admit(cache, k(4), blob(4), pending_upload=True)  # nothing uploaded is left: the oldest goes
        assert cache.contains_many([k(0)]) == [False]
        assert cache.take_removals().lost_uploads == {"evicted": 1}
        assert cache.take_removals().lost_uploads == {}
        assert cache.backlog().chunks == 2
