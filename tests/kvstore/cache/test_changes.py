"""The node's change log: every eviction, removal and finished upload, numbered in commit order, for every
process on the node (engines turn it into KV events, the node agent trims it)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from cache_workers import make_changes, read_changes

from kvstore.cache import Change, ChangeKind, NVMeCache
from kvstore.cache.changelog import TRIM_SLICE
from kvstore.cache.index import CacheIndex
from kvstore.cache.records import Entry
from kvstore.chunk import HEADER_BLOCK, stored_size
from tests.cache_helpers import admit, admit_many, locate

U = stored_size(100)
EVICTED, REMOVED, UPLOADED = ChangeKind.EVICTED, ChangeKind.REMOVED, ChangeKind.UPLOADED


def k(i: int) -> str:
    return f"llama_abc123def456_r0/abc/de_g0/{i:064x}.bin"


def log_since(cache: NVMeCache, seq: int) -> list[tuple[ChangeKind, str]]:
    changes = cache.changes_since(seq, limit=1 << 20)
    assert [c.seq for c in changes] == list(range(seq, seq + len(changes))), "numbered without gaps"
    return [(c.kind, c.key) for c in changes]


def test_every_change_is_logged_in_order_and_nothing_else(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 3 * U) as cache:
        start = cache.change_seq()
        admit(cache, k(0), b"0" * 100)
        admit(cache, k(1), b"1" * 100)
        admit(cache, k(2), b"2" * 100, pending_upload=True)
        assert log_since(cache, start) == [], "admissions within the budget change nothing"

        assert admit(cache, k(3), b"3" * 100)  # over the budget: the least recently used goes
        # Not changes: a duplicate admission, a refused one, a discard of nothing, touches, pins, a failed
        # upload, finishing what is not (or no longer) waiting, forgetting a path that is not the entry's.
        assert not admit(cache, k(3), b"3" * 100)
        cache.pin([k(1)])
        assert not admit(cache, k(9), b"9" * (4 * U))
        cache.unpin([k(1)])
        assert not cache.discard(k(9))
        cache.touch([k(1), k(9)])
        cache.flush()
        assert [c.key for c in cache.claim_uploads(10, lease_s=0)] == [k(2)]
        cache.finish_uploads([], [k(2)])
        cache.finish_uploads([k(1), k(9)])
        cache.forget(k(1), "/not/its/file")
        assert log_since(cache, start) == [(EVICTED, k(0))]

        cache.finish_uploads([k(2)])
        cache.finish_uploads([k(2)])  # a second report of the same upload
        evicted = cache.evict(U)  # all uploaded now: least recently used first (k(1) was touched)
        assert evicted == [k(2), k(3)]
        assert cache.discard(k(1))
        admit_many(cache, [(k(4), b"4" * 100), (k(5), b"5" * 100)])
        gone, bad = locate(cache, k(4)), locate(cache, k(5))
        assert gone is not None and bad is not None
        os.unlink(gone.path)
        cache.forget(k(4), gone.path)
        cache.forget(k(4), gone.path)
        with open(bad.path, "r+b") as f:
            f.seek(HEADER_BLOCK)
            f.write(b"!")
        assert cache.fsck().bad_checksums == (k(5),)
        cache.fsck(fix=True)

        assert log_since(cache, start) == [
            (EVICTED, k(0)),
            (UPLOADED, k(2)),
            (EVICTED, k(2)),
            (EVICTED, k(3)),
            (REMOVED, k(1)),
            (REMOVED, k(4)),
            (REMOVED, k(5)),
        ]
        assert cache.change_seq() == start + 7


def test_the_victims_of_one_commit_are_logged_in_eviction_order(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 4 * U) as cache:
        admit_many(cache, [(k(i), b"x" * 100) for i in range(4)])
        cache.touch([k(0)])
        start = cache.change_seq()
        assert admit_many(cache, [(k(10), b"y" * (2 * U - 4096)), (k(11), b"z" * 100)]) == [True, True]
        assert log_since(cache, start) == [(EVICTED, k(1)), (EVICTED, k(2)), (EVICTED, k(3))]


def test_a_new_reader_starts_at_change_seq_with_no_history(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 2 * U) as cache:
        for i in range(5):
            admit(cache, k(i), b"x" * 100)  # three evictions
    with NVMeCache(cache_dir, 2 * U) as reader:
        seq = reader.change_seq()
        assert reader.changes_since(seq) == []
        assert [c.key for c in reader.changes_since(seq - 3)] == [k(0), k(1), k(2)], "the history is kept"
        assert reader.discard(k(4))
        assert reader.changes_since(seq) == [Change(seq, REMOVED, k(4))]
        assert reader.change_seq() == seq + 1


def test_changes_since_reads_in_pages(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, U) as cache:
        start = cache.change_seq()
        for i in range(11):
            admit(cache, k(i), b"x" * 100)  # each evicts the one before
        pages: list[list[Change]] = []
        seq = start
        while page := cache.changes_since(seq, limit=4):
            pages.append(page)
            seq = page[-1].seq + 1
        assert [len(p) for p in pages] == [4, 4, 2]
        assert [c.key for p in pages for c in p] == [k(i) for i in range(10)]
        assert seq == cache.change_seq()


def test_trim_changes_keeps_the_newest(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, U) as cache:
        start = cache.change_seq()
        for i in range(11):
            admit(cache, k(i), b"x" * 100)  # ten changes
        assert cache.trim_changes(3) == 7
        kept = cache.changes_since(start)
        # A reader that fell behind sees a gap: the first change it gets is not the one it asked for.
        assert [(c.seq, c.key) for c in kept] == [(start + 7 + i, k(7 + i)) for i in range(3)]
        assert cache.trim_changes(3) == 0
        assert cache.trim_changes(100) == 0
        assert cache.change_seq() == start + 10, "trimming does not renumber"
        admit(cache, k(11), b"x" * 100)
        assert cache.changes_since(start + 10) == [Change(start + 10, EVICTED, k(10))]
        assert cache.trim_changes(0) == 4
        assert cache.changes_since(start) == []
        assert cache.change_seq() == start + 11
        admit(cache, k(12), b"x" * 100)
        assert cache.changes_since(start) == [Change(start + 11, EVICTED, k(11))]


def test_without_an_agent_the_log_stays_within_its_bound(cache_dir: Path) -> None:
    """Nobody trims while no node agent runs: the transactions that append keep the log bounded (a million
    changes once made a 118 MB index, and the first trim then stalled every store)."""
    with NVMeCache(cache_dir, U, change_log_max=50) as cache:
        start = cache.change_seq()
        for batch in range(3):  # each admission evicts the one before: 299 changes
            admit_many(cache, [(k(100 * batch + i), b"x" * 100) for i in range(100)])
        kept = cache.changes_since(0, limit=1 << 20)
        assert [c.key for c in kept] == [k(i) for i in range(249, 299)], "the newest 50 stay"
        assert cache.change_seq() == start + 299, "numbering goes on"


def test_a_log_over_its_bound_shrinks_a_little_with_each_append(cache_dir: Path) -> None:
    """A log that grew under a larger bound (an earlier release's) is not trimmed in one transaction: each
    append drops a few more than it adds until the log is within the bound again."""
    with NVMeCache(cache_dir, U) as cache:
        admit_many(cache, [(k(i), b"x" * 100) for i in range(301)])
    with NVMeCache(cache_dir, U, change_log_max=100) as cache:
        sizes = []
        for i in range(5):
            admit(cache, k(1000 + i), b"x" * 100)
            sizes.append(len(cache.changes_since(0, limit=1 << 20)))
        assert sizes == [300 - 64, 300 - 128, 300 - 192, 100, 100]


def test_a_trim_drops_a_slice_per_transaction(cache_dir: Path) -> None:
    """One writer at a time: an engine's store waits for whatever one trimming transaction does."""
    n = TRIM_SLICE + 500
    with NVMeCache(cache_dir, U) as cache:
        index = CacheIndex(cache_dir)  # index entries alone make changes fast (the files play no part)
        try:
            start = index.change_seq()
            entry = Entry(size=U, checksum=bytes(16), last_access_ns=1, token=bytes(8))
            assert all(a.admitted for a in index.admit_many([(k(i), entry) for i in range(n + 1)], U, {}))
            assert index.trim_changes(10, max_rows=300) == 300, "one transaction, one slice"
            assert index.changes_since(0, limit=1)[0].seq == start + 300
        finally:
            index.close()
        assert cache.trim_changes(10) == n - 310, "slice after slice, until only the newest are left"
        assert [c.seq for c in cache.changes_since(0, limit=1 << 20)] == list(
            range(start + n - 10, start + n)
        )


def test_another_process_sees_the_changes(cache_dir: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    with NVMeCache(cache_dir, 4 * U) as cache, ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        # Open here first, as a running engine is when the node agent evicts and uploads.
        seq = cache.change_seq()
        start, made = pool.submit(make_changes, str(cache_dir), U).result(timeout=120)
        assert start == seq
        assert len(made) == 5
        assert [(c.kind.name, c.key) for c in cache.changes_since(seq)] == made
        # And the other way round: what this process changes, a process that opens the cache later reads.
        located = cache.locate_many([made[-1][1]])[0]
        assert located is not None
        assert cache.discard(located.key)
        seen = pool.submit(read_changes, str(cache_dir), seq).result(timeout=120)
        assert seen == [*made, (REMOVED.name, located.key)]
