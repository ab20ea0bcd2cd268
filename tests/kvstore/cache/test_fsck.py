from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from cache_workers import blob_for, key_for

from kvstore.cache import NVMeCache, rebuild_index
from kvstore.chunk import encode_legacy
from kvstore.errors import CacheError
from tests.cache_helpers import admit, evicted_since, locate, read_chunk


def filled(cache_dir: Path, n: int = 6) -> NVMeCache:
    cache = NVMeCache(cache_dir, 10**6)
    for i in range(n):
        assert admit(cache, key_for(i), blob_for(key_for(i)))
    return cache


def path_of(cache: NVMeCache, key: str) -> Path:
    loc = locate(cache, key)
    assert loc is not None
    return Path(loc.path)


def test_clean_cache_is_clean(cache_dir: Path) -> None:
    with filled(cache_dir) as cache:
        report = cache.fsck()
        assert report.clean, report
        assert (report.entries, report.files) == (6, 6)
        summary = report.as_dict()
        assert summary["clean"] is True and summary["orphan_files"] == [] and summary["usage_drift"] == 0
        json.dumps(summary)
        assert report.recorded_used_bytes == report.actual_used_bytes == cache.usage().used_bytes


def test_flipped_byte_is_a_bad_checksum_and_fix_removes_it(cache_dir: Path) -> None:
    with filled(cache_dir) as cache:
        victim = key_for(2)
        path = path_of(cache, victim)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        seq = cache.change_seq()
        report = cache.fsck()
        assert report.bad_checksums == (victim,)
        assert not report.clean and not report.fixed
        assert cache.contains_many([victim]) == [True], "fix=False changes nothing"
        assert cache.change_seq() == seq, "fix=False logs nothing"
        fixed = cache.fsck(fix=True)
        assert fixed.bad_checksums == (victim,) and fixed.fixed
        assert not path.exists() and cache.contains_many([victim]) == [False]
        assert evicted_since(cache, seq) == [victim], "the repair is in the node's change log"
        assert cache.fsck().clean


def test_another_keys_chunk_or_a_version_1_chunk_is_bad(cache_dir: Path) -> None:
    with filled(cache_dir) as cache:
        swapped, legacy = key_for(1), key_for(3)
        shutil.copyfile(path_of(cache, key_for(0)), path_of(cache, swapped))  # a valid chunk, wrong name
        path_of(cache, legacy).write_bytes(encode_legacy(blob_for(legacy)))
        assert sorted(cache.fsck().bad_checksums) == sorted([swapped, legacy])
        assert cache.fsck(verify_checksums=False).clean
        seq = cache.change_seq()
        report = cache.fsck(fix=True)
        assert sorted(evicted_since(cache, seq)) == sorted([swapped, legacy])
        assert cache.contains_many([swapped, legacy]) == [False, False]
        assert read_chunk(cache, key_for(0)) == blob_for(key_for(0))
        assert report.lost_uploads == 0


def test_fix_counts_removed_chunks_that_were_never_uploaded(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10**6) as cache:
        assert admit(cache, key_for(0), blob_for(key_for(0)), pending_upload=True)
        os.unlink(path_of(cache, key_for(0)))
        assert cache.fsck(fix=True).lost_uploads == 1
        assert cache.take_removals().lost_uploads == {"fsck": 1}
        assert cache.backlog().chunks == 0 and cache.fsck().clean


def test_orphans_missing_and_drift(cache_dir: Path) -> None:
    with filled(cache_dir) as cache:
        stray = cache_dir / "chunks" / "ab" / "stray-file"
        stray.parent.mkdir(exist_ok=True)
        stray.write_bytes(b"x")
        (cache_dir / "chunks" / "ab" / ".1.deadbeef.0011223344556677.tmp").write_bytes(b"partial")
        gone = key_for(4)
        os.unlink(path_of(cache, gone))
        s = cache._index._db()
        with s.env.begin(write=True) as txn:
            txn.put(b"used_bytes", struct.pack("<Q", 1), db=s.meta)
        report = cache.fsck()
        assert report.orphan_files == ("chunks/ab/.1.deadbeef.0011223344556677.tmp", "chunks/ab/stray-file")
        assert report.missing_files == (gone,)
        assert report.recorded_used_bytes == 1 and report.usage_drift > 0
        assert report.problems == 4
        seq = cache.change_seq()
        cache.fsck(fix=True)
        assert evicted_since(cache, seq) == [gone], "orphans and drift had no entry to log"
        after = cache.fsck()
        assert after.clean, after
        assert after.entries == 5 and after.actual_used_bytes == cache.usage().used_bytes
        assert not stray.exists()
        for i in (0, 1, 2, 3, 5):
            assert read_chunk(cache, key_for(i)) == blob_for(key_for(i))


def test_young_orphans_are_spared(cache_dir: Path) -> None:
    with filled(cache_dir, 1) as cache:
        in_flight = cache_dir / "chunks" / "ab" / ".1.in-flight.tmp"
        in_flight.parent.mkdir(exist_ok=True)
        in_flight.write_bytes(b"...")
        assert cache.fsck(fix=True, orphan_min_age_s=3600).clean
        assert in_flight.exists()
        assert cache.fsck().orphan_files == ("chunks/ab/.1.in-flight.tmp",)


def test_lru_drift_is_repaired(cache_dir: Path) -> None:
    with filled(cache_dir) as cache:
        s = cache._index._db()
        with s.env.begin(write=True) as txn:
            txn.drop(s.lru, delete=False)
        assert cache.fsck().lru_mismatches == 6
        cache.fsck(fix=True)
        assert cache.fsck().clean


@pytest.mark.parametrize("damage", ["truncate", "zero the meta pages"])
def test_a_damaged_index_is_refused_at_open_and_rebuilt_from_the_chunk_files(
    cache_dir: Path, damage: str
) -> None:
    with filled(cache_dir, 40) as cache:
        cache.pin([key_for(0)])
        admit(cache, key_for(99), blob_for(key_for(99)), pending_upload=True)
    data = cache_dir / "index" / "data.mdb"
    if damage == "truncate":
        os.truncate(data, 8192)
    else:
        with open(data, "r+b") as f:
            f.write(bytes(8192))
    # In a child: before the check, opening such an index died of SIGBUS on its first read.
    probe = subprocess.run(
        [sys.executable, "-c", f"from kvstore.cache import NVMeCache; NVMeCache({str(cache_dir)!r}, 10**6)"],
        capture_output=True,
        text=True,
    )
    assert probe.returncode == 1, probe
    assert "damaged" in probe.stderr and "fsck --fix" in probe.stderr
    with pytest.raises(CacheError, match="damaged"):
        NVMeCache(cache_dir, 10**6)

    report = rebuild_index(cache_dir)
    assert report.entries == 41 and report.skipped_files == 0
    assert Path(report.kept_aside).is_dir()
    with NVMeCache(cache_dir, 10**6) as cache:
        assert cache.fsck().clean
        for i in [*range(40), 99]:
            assert read_chunk(cache, key_for(i)) == blob_for(key_for(i))
        # Whether a chunk had been uploaded was in the lost index: every one is queued again.
        assert cache.backlog().chunks == 41
