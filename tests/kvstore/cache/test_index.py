from __future__ import annotations

import os
import struct
from pathlib import Path

import lmdb
import pytest

from kvstore.cache import SCHEMA_VERSION, NVMeCache
from kvstore.cache.claims import clock_ns
from kvstore.cache.index import CacheIndex
from kvstore.cache.records import MAX_KEY_BYTES, Backlog, Change, ChangeKind, Entry, Eviction, encode_key
from kvstore.errors import CacheError
from tests.cache_helpers import admit_many


def entry(size: int, ts: int) -> Entry:
    return Entry(size=size, checksum=bytes(range(16)), last_access_ns=ts, token=os.urandom(8))


def test_entry_is_compact_and_roundtrips() -> None:
    e = entry(123, 456)
    raw = e.pack()
    assert len(raw) == 58
    assert Entry.unpack(raw) == e


def test_encode_key_limits() -> None:
    assert encode_key("a") == b"a"
    assert len(encode_key("x" * MAX_KEY_BYTES)) == MAX_KEY_BYTES
    with pytest.raises(CacheError):
        encode_key("x" * (MAX_KEY_BYTES + 1))


def test_schema_version_is_recorded(tmp_path: Path) -> None:
    CacheIndex(tmp_path).close()
    with lmdb.open(str(tmp_path / "index"), max_dbs=8) as env:
        meta = env.open_db(b"meta")
        with env.begin() as txn:
            assert txn.get(b"schema_version", db=meta) == struct.pack("<Q", SCHEMA_VERSION)


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    CacheIndex(tmp_path).close()
    with lmdb.open(str(tmp_path / "index"), max_dbs=8) as env:
        meta = env.open_db(b"meta")
        with env.begin(write=True) as txn:
            txn.put(b"schema_version", struct.pack("<Q", SCHEMA_VERSION + 1), db=meta)
    with pytest.raises(CacheError, match=f"schema version {SCHEMA_VERSION + 1}, newer"):
        NVMeCache(tmp_path, 1000)
    # The refused environment was not left in the registry: fixing the schema makes it usable again.
    with lmdb.open(str(tmp_path / "index"), max_dbs=8) as env:
        meta = env.open_db(b"meta")
        with env.begin(write=True) as txn:
            txn.put(b"schema_version", struct.pack("<Q", SCHEMA_VERSION), db=meta)
    NVMeCache(tmp_path, 1000).close()


def test_older_schema_is_refused_until_migrated(tmp_path: Path) -> None:
    CacheIndex(tmp_path).close()
    with lmdb.open(str(tmp_path / "index"), max_dbs=8) as env:
        meta = env.open_db(b"meta")
        with env.begin(write=True) as txn:
            txn.put(b"schema_version", struct.pack("<Q", SCHEMA_VERSION - 1), db=meta)
    with pytest.raises(CacheError, match="kvstore migrate"):
        NVMeCache(tmp_path, 1000)


def _leave_pages_unwritten(index_dir: Path, n: int = 2000) -> bool:
    """Insert `n` records in one transaction and delete them in the next, as an eviction's file names are:
    the second allocates pages at the end of the file and frees them again before it commits. Whether the
    file now ends before the last page its meta page counts."""
    with lmdb.open(str(index_dir), max_dbs=16) as env:
        scratch = env.open_db(b"scratch")  # a table of its own: the cache's tables are left as they were
        with env.begin(write=True) as txn:
            for i in range(n):
                txn.put(b"%08d" % i + b"k" * 72, b"v" * 60, db=scratch)
        with env.begin(write=True) as txn:
            for i in range(n):
                txn.delete(b"%08d" % i + b"k" * 72, db=scratch)
        return (env.info()["last_pgno"] + 1) * 4096 > (index_dir / "data.mdb").stat().st_size


def test_an_index_whose_last_pages_were_never_written_opens(tmp_path: Path) -> None:
    """LMDB does not write the pages a transaction allocated at the end of the file and freed again before
    it committed (they are listed as free): the file may end before the last page its meta page counts. The
    index is sound, nothing reads those pages, and it was once refused as damaged."""
    with NVMeCache(tmp_path, 1 << 20) as cache:
        assert admit_many(cache, [("k", b"x" * 100)]) == [True]
    assert _leave_pages_unwritten(tmp_path / "index"), "the case itself: the file ends before its last page"
    with NVMeCache(tmp_path, 1 << 20) as cache:
        assert cache.contains_many(["k"]) == [True]
    os.truncate(tmp_path / "index" / "data.mdb", 8192)  # a truncated file still is refused
    with pytest.raises(CacheError, match="damaged"):
        NVMeCache(tmp_path, 1 << 20)


def queued(size: int, ts: int, at: int) -> Entry:
    return Entry(size=size, checksum=bytes(16), last_access_ns=ts, token=os.urandom(8), queued_ns=at)


def test_upload_journal_claims_leases_retries_and_finishes(tmp_path: Path) -> None:
    index = CacheIndex(tmp_path)
    try:
        index.admit_many([("b", queued(10, 1, 200)), ("a", queued(20, 2, 100)), ("c", entry(5, 3))], 100, {})
        assert index.backlog() == Backlog(chunks=2, bytes=30, oldest_queued_ns=100)
        # Oldest first, and a claim holds: a second claimer (another process) gets nothing until it expires.
        assert [k for k, _ in index.claim_uploads(10, now_ns=1000, lease_ns=500)] == ["a", "b"]
        assert index.claim_uploads(10, now_ns=1400, lease_ns=500) == []
        assert [k for k, _ in index.claim_uploads(1, now_ns=1600, lease_ns=500)] == ["a"]
        # "a" uploaded; "b" failed and waits until its retry time.
        index.finish_uploads(["a"], ["b"], retry_at_ns=5000)
        assert index.backlog() == Backlog(chunks=1, bytes=10, oldest_queued_ns=200)
        assert index.get("a") is not None and not index.get("a").pending_upload  # type: ignore[union-attr]
        assert index.claim_uploads(10, now_ns=4999, lease_ns=1) == []
        assert [k for k, _ in index.claim_uploads(10, now_ns=5000, lease_ns=1)] == ["b"]
        assert index.audit()[4] == 0
    finally:
        index.close()


def test_evicting_or_removing_a_queued_chunk_leaves_the_journal(tmp_path: Path) -> None:
    index = CacheIndex(tmp_path)
    try:
        index.admit_many([("a", queued(10, 1, 100)), ("b", queued(10, 2, 200))], 20, {})
        result = index.admit("c", entry(10, 3), 20, {})
        assert [(k, v.pending_upload) for k, v in result.victims] == [("a", True)]
        index.remove("b")
        assert index.backlog() == Backlog(chunks=0, bytes=0, oldest_queued_ns=0)
        assert index.claim_uploads(10, now_ns=10**18, lease_ns=1) == []
        assert index.audit()[4] == 0
    finally:
        index.close()


def test_rebuild_restores_the_journal(tmp_path: Path) -> None:
    index = CacheIndex(tmp_path)
    try:
        index.admit_many([("a", queued(10, 1, 100)), ("b", entry(10, 2))], 100, {})
        s = index._db()
        with s.env.begin(write=True) as txn:
            txn.drop(s.uploads, delete=False)
        assert index.audit()[4] > 0
        index.rebuild()
        assert index.audit()[4] == 0
        assert [k for k, _ in index.claim_uploads(10, now_ns=10**18, lease_ns=1)] == ["a"]
    finally:
        index.close()


def test_admit_evicts_oldest_and_skips_pinned(tmp_path: Path) -> None:
    index = CacheIndex(tmp_path)
    try:
        for i, key in enumerate("abc"):
            assert index.admit(key, entry(10, 100 + i), 30, {}).admitted
        index.change_pins(["a"], +1)
        result = index.admit("d", entry(15, 200), 30, {})
        assert result.admitted
        assert [k for k, _ in result.victims] == ["b", "c"]
        assert index.counters() == (25, 2, 1)
        assert not index.admit("d", entry(1, 300), 30, {}).admitted, "duplicate"
        assert not index.admit("e", entry(25, 300), 30, {}).admitted, "only pinned 'a' could make room"
        assert index.counters() == (25, 2, 1)
    finally:
        index.close()


def test_touches_applied_in_admit_txn_reorder_lru(tmp_path: Path) -> None:
    index = CacheIndex(tmp_path)
    try:
        index.admit("a", entry(10, 100), 20, {})
        index.admit("b", entry(10, 101), 20, {})
        result = index.admit("c", entry(10, 102), 20, {"a": 500, "zzz-unknown": 1})
        assert [k for k, _ in result.victims] == ["b"]
        a = index.get("a")
        assert a is not None and a.last_access_ns == 500
        index.apply_touches({"a": 50})  # older than what is recorded: ignored
        a = index.get("a")
        assert a is not None and a.last_access_ns == 500
    finally:
        index.close()


def test_remove_is_token_guarded(tmp_path: Path) -> None:
    index = CacheIndex(tmp_path)
    try:
        e = entry(10, 1)
        index.admit("a", e, 100, {})
        assert index.remove("a", token=b"\1" * 8) is None
        assert index.remove("a", token=e.token) == e
        assert index.counters() == (0, 0, 0)
    finally:
        index.close()


def test_audit_and_rebuild_repair_drift(tmp_path: Path) -> None:
    index = CacheIndex(tmp_path)
    try:
        index.admit("a", entry(10, 1), 100, {})
        index.admit("b", entry(20, 2), 100, {})
        s = index._db()
        with s.env.begin(write=True) as txn:
            txn.put(b"used_bytes", struct.pack("<Q", 999), db=s.meta)
            txn.drop(s.lru, delete=False)
        assert index.audit() == (999, 30, 2, 2, 2)
        index.rebuild()
        assert index.audit() == (30, 30, 2, 2, 0)
    finally:
        index.close()


def test_iter_entries_in_batches(tmp_path: Path) -> None:
    index = CacheIndex(tmp_path)
    try:
        for i in range(25):
            index.admit(f"k{i:02d}", entry(1, i), 1000, {})
        assert [k for k, _ in index.iter_entries(batch=7)] == [f"k{i:02d}" for i in range(25)]
    finally:
        index.close()


def test_changes_are_logged_by_the_transactions_that_make_them(tmp_path: Path) -> None:
    index = CacheIndex(tmp_path)
    try:
        seq = index.change_seq()
        index.admit_many([("a", entry(10, 1)), ("b", queued(10, 2, 50))], 20, {})
        assert index.admit("c", entry(10, 3), 20, {}).victims[0][0] == "a"
        assert index.remove("b", token=b"\1" * 8) is None  # another admission's entry: nothing happens
        index.finish_uploads(["b"])
        index.finish_uploads(["b", "zzz"])
        assert index.remove("b") is not None
        assert index.evict(10) == Eviction(), "nothing to do"
        eviction = index.evict(0)
        assert [k for k, _ in eviction.victims] == ["c"]
        assert index.changes_since(seq) == [
            Change(seq, ChangeKind.EVICTED, "a"),
            Change(seq + 1, ChangeKind.UPLOADED, "b"),
            Change(seq + 2, ChangeKind.REMOVED, "b"),
            Change(seq + 3, ChangeKind.EVICTED, "c"),
        ]
        assert index.change_seq() == seq + 4
        assert index.changes_since(seq + 4) == []
        assert index.counters() == (0, 0, 0) and index.audit()[4] == 0
    finally:
        index.close()


def test_evict_reports_the_victims_an_uploader_holds(tmp_path: Path) -> None:
    index = CacheIndex(tmp_path)
    try:
        index.admit_many([("a", queued(10, 1, 100)), ("b", queued(10, 2, 200)), ("c", entry(10, 3))], 100, {})
        assert [k for k, _ in index.claim_uploads(1, now_ns=clock_ns(), lease_ns=60 * 10**9)] == ["a"]
        eviction = index.evict(0)
        assert [k for k, _ in eviction.victims] == ["c", "a", "b"], "uploaded first, then the oldest"
        assert eviction.uploading == frozenset({"a"})
        assert index.backlog() == Backlog(chunks=0, bytes=0, oldest_queued_ns=0)
        assert index.audit() == (0, 0, 0, 0, 0)
    finally:
        index.close()


def test_a_chunk_evicted_while_claimed_is_settled_by_its_upload(tmp_path: Path) -> None:
    """Evicted while an uploader holds it: neither lost nor safe until the upload says (the node's count
    and the change log follow)."""
    index = CacheIndex(tmp_path)
    try:
        index.admit_many(
            [("a", queued(10, 1, 100)), ("b", queued(10, 2, 200)), ("c", queued(10, 3, 300))], 100, {}
        )
        assert [k for k, _ in index.claim_uploads(2, now_ns=clock_ns(), lease_ns=60 * 10**9)] == ["a", "b"]
        seq = index.change_seq()
        assert index.evict(0).uploading == frozenset({"a", "b"})
        assert index.read_counters() == {"uploads_lost": 1}, "c: nobody held it"
        assert index.finish_uploads(["a"], gone=["b"]) == ["b"]
        assert index.read_counters() == {"uploads_lost": 2}
        assert index.take_lost() == {"evicted": 2}
        assert [(c.kind, c.key, c.uploaded) for c in index.changes_since(seq)] == [
            (ChangeKind.EVICTED, "a", False),
            (ChangeKind.EVICTED, "b", False),
            (ChangeKind.EVICTED, "c", False),
            (ChangeKind.UPLOADED, "a", True),
        ]
        assert index.finish_uploads(["b"], gone=["a"]) == [], "settled once"
        assert index.read_counters() == {"uploads_lost": 2}
    finally:
        index.close()
