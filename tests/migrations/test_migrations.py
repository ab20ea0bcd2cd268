"""Migrations against a hand-built version-0 LMDB index and a real S3 bucket."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import lmdb
import pytest
from kvstore.migrations import LATEST_VERSION, Applied, MigrationError, load_steps, migrate
from kvstore.migrations.runner import LAYOUT_KEY

from kvstore.cache.index import CacheIndex
from kvstore.cache.nvme import NVMeCache
from kvstore.stores.base import ObjectStore

_ENTRY = struct.Struct("<Q16sQ8sB")
_U64 = struct.Struct("<Q")


def _build_v0_index(cache_dir: Path) -> None:
    """An index as written before schema versioning: entries and pins; no counters, version or LRU."""
    env = lmdb.open(str(cache_dir / "index"), max_dbs=8, map_size=1 << 24)
    entries, pins = env.open_db(b"entries"), env.open_db(b"pins")
    env.open_db(b"lru")
    env.open_db(b"meta")
    with env.begin(write=True) as txn:
        for i, size in enumerate([100, 200, 300]):
            txn.put(
                f"ns_r0/abc/de_g0/{i}.bin".encode(),
                _ENTRY.pack(size, b"\x00" * 16, 1000 + i, b"t" * 8, 1),
                db=entries,
            )
        txn.put(b"ns_r0/abc/de_g0/1.bin", _U64.pack(1), db=pins)
    env.close()


def _meta(cache_dir: Path) -> dict[bytes, int]:
    env = lmdb.open(str(cache_dir / "index"), max_dbs=8, map_size=1 << 24, readonly=True)
    try:
        meta, lru = env.open_db(b"meta", create=False), env.open_db(b"lru", create=False)
        with env.begin() as txn:
            out = {k: _U64.unpack(v)[0] for k, v in txn.cursor(db=meta)}
            out[b"lru_records"] = sum(1 for _ in txn.cursor(db=lru))
        return out
    finally:
        env.close()


def test_steps_are_numbered_without_gaps() -> None:
    steps = load_steps()
    assert [s.version for s in steps] == list(range(1, LATEST_VERSION + 1))
    assert steps[0].module.endswith("m0001_baseline")


def test_migrates_v0_index_and_bucket(tmp_path: Path, s3_store: ObjectStore) -> None:
    _build_v0_index(tmp_path)
    applied = migrate(cache_dir=tmp_path, store=s3_store)
    assert [(a.target, a.version) for a in applied] == [("cache", 1), ("bucket", 1)]
    assert all(isinstance(a, Applied) and a.describe for a in applied)
    meta = _meta(tmp_path)
    assert meta[b"schema_version"] == 1 and meta[b"used_bytes"] == 600 and meta[b"entries"] == 3
    assert meta[b"lru_records"] == 2  # the pinned entry stays out of eviction order
    assert json.loads(s3_store.get(LAYOUT_KEY) or b"") == {"version": 1}
    # The migrated index opens cleanly and agrees with itself.
    index = CacheIndex(tmp_path)
    try:
        rec_used, used, rec_count, count, lru_mismatch = index.audit()
        assert (rec_used, rec_count, lru_mismatch) == (used, count, 0) == (600, 3, 0)
    finally:
        index.close()
    # Idempotent: nothing left to do.
    assert migrate(cache_dir=tmp_path, store=s3_store) == []


def test_fresh_targets(tmp_path: Path, s3_store: ObjectStore) -> None:
    assert migrate(cache_dir=tmp_path / "none") == []  # no index yet: the cache creates it at v1
    with NVMeCache(tmp_path / "c", 1 << 20) as cache:
        cache.put("k/a.bin", b"x")
        with pytest.raises(MigrationError, match="open in this process"):
            migrate(cache_dir=tmp_path / "c")
    assert migrate(cache_dir=tmp_path / "c") == []
    assert [a.target for a in migrate(store=s3_store)] == ["bucket"]


def test_refuses_newer(tmp_path: Path, s3_store: ObjectStore) -> None:
    _build_v0_index(tmp_path)
    env = lmdb.open(str(tmp_path / "index"), max_dbs=8, map_size=1 << 24)
    meta = env.open_db(b"meta")  # before the write txn: open_db inside one would wait on its own lock
    with env.begin(write=True) as txn:
        txn.put(b"schema_version", _U64.pack(LATEST_VERSION + 1), db=meta)
    env.close()
    with pytest.raises(MigrationError, match="newer than this kvstore"):
        migrate(cache_dir=tmp_path)
    s3_store.put(LAYOUT_KEY, json.dumps({"version": LATEST_VERSION + 1}).encode())
    with pytest.raises(MigrationError, match="newer than this kvstore"):
        migrate(store=s3_store)
    s3_store.put(LAYOUT_KEY, b"[]")
    with pytest.raises(MigrationError, match="malformed"):
        migrate(store=s3_store)
