"""Migrations against a hand-built version-0 LMDB index and a real S3 bucket."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import lmdb
import pytest

from kvstore.cache.nvme import NVMeCache
from kvstore.chunk import Codec, decode, encode, encode_legacy
from kvstore.errors import CacheError
from kvstore.layout import LAYOUT_KEY
from kvstore.migrations import LATEST_VERSION, Applied, MigrationError, load_steps, migrate
from kvstore.stores.base import ObjectStore
from tests.cache_helpers import admit

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
    assert [(a.target, a.version) for a in applied] == [
        ("cache", 1),
        ("cache", 2),
        ("bucket", 1),
        ("bucket", 2),
    ]
    assert all(isinstance(a, Applied) and a.describe for a in applied)
    meta = _meta(tmp_path)
    # Version-1 chunks are not bound to their keys: the cache drops them (keeping its pins).
    assert meta[b"schema_version"] == 2 and meta[b"used_bytes"] == 0 and meta[b"entries"] == 0
    assert json.loads(s3_store.get(LAYOUT_KEY) or b"") == {"version": 2}
    # The migrated index opens cleanly and agrees with itself.
    with NVMeCache(tmp_path, 1 << 20) as cache:
        assert cache.fsck().clean
        assert cache.pinned("ns_r0/abc/de_g0/1.bin") == 1
    # Idempotent: nothing left to do.
    assert migrate(cache_dir=tmp_path, store=s3_store) == []


def test_version_1_cache_files_are_dropped_and_the_cache_opens(tmp_path: Path) -> None:
    """A cache written by the previous release: real version-1 files under a version-1 index."""
    from kvstore.cache.files import ChunkFiles

    _build_v0_index(tmp_path)
    files = ChunkFiles(tmp_path, direct_io=False)
    paths = [
        files.write(f"ns_r0/abc/de_g0/{i}.bin", b"t" * 8, [encode_legacy(b"old" * 100)]) for i in range(3)
    ]
    env = lmdb.open(str(tmp_path / "index"), max_dbs=8, map_size=1 << 24)
    meta = env.open_db(b"meta")  # before the write txn: open_db inside one would wait on its own lock
    with env.begin(write=True) as txn:
        txn.put(b"schema_version", _U64.pack(1), db=meta)
    env.close()
    with pytest.raises(CacheError, match="kvstore migrate"):
        NVMeCache(tmp_path, 1 << 20)
    assert [a.version for a in migrate(cache_dir=tmp_path)] == [2]
    assert not any(Path(p).exists() for p in paths)
    with NVMeCache(tmp_path, 1 << 20) as cache:
        assert cache.usage().entries == 0 and cache.fsck().clean


def test_version_1_bucket_chunks_are_rewritten_bound_to_their_keys(s3_store: ObjectStore) -> None:
    old, bad, current, foreign = (f"ns_r0/abc/de_g0/{name}.bin" for name in ("old", "bad", "v2", "foreign"))
    s3_store.put(old, encode_legacy(b"kv" * 3000, Codec.ZSTD))
    damaged = bytearray(encode_legacy(b"kv" * 100))
    damaged[-1] ^= 1
    s3_store.put(bad, bytes(damaged))
    v2 = encode(current, b"new" * 100).to_bytes()
    s3_store.put(current, v2)
    s3_store.put(foreign, b"raw bytes another tool wrote")
    s3_store.put(LAYOUT_KEY, json.dumps({"version": 1}).encode())
    assert [a.version for a in migrate(store=s3_store)] == [2]
    assert decode(old, s3_store.get(old) or b"") == b"kv" * 3000
    assert s3_store.get(bad) == bytes(damaged), "what fails its check is left as it was"
    assert s3_store.get(current) == v2 and s3_store.get(foreign) == b"raw bytes another tool wrote"
    assert migrate(store=s3_store) == []


def test_fresh_targets(tmp_path: Path, s3_store: ObjectStore) -> None:
    assert migrate(cache_dir=tmp_path / "none") == []  # no index yet: the cache creates it current
    with NVMeCache(tmp_path / "c", 1 << 20) as cache:
        assert admit(cache, "k/a.bin", b"x")
        assert migrate(cache_dir=tmp_path / "c") == []  # open here, so current (an older one is refused)
    assert migrate(cache_dir=tmp_path / "c") == []
    assert [(a.target, a.version) for a in migrate(store=s3_store)] == [("bucket", 1), ("bucket", 2)]


def test_an_index_from_before_the_change_log_opens_and_logs(tmp_path: Path) -> None:
    """Schema 2 as the previous release wrote it, without the ``changes`` sub-database or its counter: the
    cache adds them at open (no migration), keeps every entry and numbers changes from 1."""
    with NVMeCache(tmp_path, 1 << 20) as cache:
        assert admit(cache, "k/a.bin", b"a") and admit(cache, "k/b.bin", b"b")
    env = lmdb.open(str(tmp_path / "index"), max_dbs=8, map_size=1 << 24)
    meta = env.open_db(b"meta")
    changes = env.open_db(b"changes")
    with env.begin(write=True) as txn:
        txn.drop(changes, delete=True)
        txn.delete(b"changes_next", db=meta)
    env.close()
    assert migrate(cache_dir=tmp_path) == []
    with NVMeCache(tmp_path, 1 << 20) as cache:
        assert cache.usage().entries == 2 and cache.fsck().clean
        assert cache.change_seq() == 1 and cache.changes_since(1) == []
        assert cache.discard("k/a.bin")
        assert [(c.seq, c.key) for c in cache.changes_since(1)] == [(1, "k/a.bin")]


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
