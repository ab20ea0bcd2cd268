"""fsck for the NVMe cache: reconcile the LMDB index with the files on disk, optionally repair.

Findings:
* orphan files: on disk but named by no index entry (leftovers of crashed writers, stale tmp files,
  stray files);
* missing files: indexed, but the file is gone;
* bad checksums: the file's size or xxh3-128 differs from the entry, or the blob fails
  ``kvstore.chunk.decode``;
* drift: the usage/entry counters or the LRU database disagree with the entries.

Repair (``fix=True``) drops entries of missing and bad files (index first), rebuilds counters and LRU order,
and only then deletes bad and orphan files. The report describes what was found; a second run is clean.

Races with live writers: the disk is scanned *before* the index is read, so a file renamed and committed in
between is either unseen or indexed; a missing file is re-checked before it is reported. A file renamed but
not yet committed looks like an orphan; ``orphan_min_age_s`` spares young files for that reason. Deleting one
anyway is safe: its entry then points at nothing, which readers treat as a miss and clean up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from kvstore.cache.files import ChunkFiles
from kvstore.cache.index import CacheIndex, Entry
from kvstore.errors import ChunkError


@dataclass(frozen=True)
class FsckReport:
    entries: int
    files: int
    orphan_files: tuple[str, ...]  # paths relative to the cache directory
    missing_files: tuple[str, ...]  # keys
    bad_checksums: tuple[str, ...]  # keys
    recorded_used_bytes: int
    actual_used_bytes: int
    recorded_entries: int
    lru_mismatches: int
    fixed: bool

    @property
    def usage_drift(self) -> int:
        return self.actual_used_bytes - self.recorded_used_bytes

    @property
    def entries_drift(self) -> int:
        return self.entries - self.recorded_entries

    @property
    def problems(self) -> int:
        return (
            len(self.orphan_files)
            + len(self.missing_files)
            + len(self.bad_checksums)
            + (self.usage_drift != 0)
            + (self.entries_drift != 0)
            + self.lru_mismatches
        )

    @property
    def clean(self) -> bool:
        return self.problems == 0

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready summary (the CLI and admin API print it)."""
        return {
            "clean": self.clean,
            "fixed": self.fixed,
            "entries": self.entries,
            "files": self.files,
            "orphan_files": list(self.orphan_files),
            "missing_files": list(self.missing_files),
            "bad_checksums": list(self.bad_checksums),
            "recorded_used_bytes": self.recorded_used_bytes,
            "actual_used_bytes": self.actual_used_bytes,
            "usage_drift": self.usage_drift,
            "recorded_entries": self.recorded_entries,
            "entries_drift": self.entries_drift,
            "lru_mismatches": self.lru_mismatches,
        }


def _default_verifier() -> Callable[[bytes], object]:
    from kvstore.chunk import decode  # imported late: the cache itself never interprets blobs

    return decode


def _blob_ok(path: str, entry: Entry, verify: Callable[[bytes], object]) -> bool:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return True  # evicted while we looked: not corruption
    if len(data) != entry.size or xxhash.xxh3_128_digest(data) != entry.checksum:
        return False
    try:
        verify(data)
    except ChunkError:
        return False
    return True


def check(
    index: CacheIndex,
    files: ChunkFiles,
    *,
    fix: bool = False,
    verify_checksums: bool = True,
    orphan_min_age_s: float = 0.0,
    verify: Callable[[bytes], object] | None = None,
) -> tuple[FsckReport, list[str]]:
    """Run fsck; returns the report and the keys whose entries a repair removed."""
    verify = verify or _default_verifier()
    disk = {f.name: f for f in files.scan()}
    young_after = time.time_ns() - int(orphan_min_age_s * 1e9)

    expected: set[str] = set()
    missing: list[tuple[str, bytes]] = []
    bad: list[tuple[str, bytes]] = []
    for key, entry in index.iter_entries():
        name = files.relpath(key, entry.token)
        expected.add(name)
        path = os.path.join(files.root, name)
        if name not in disk:
            if not os.path.exists(path):  # committed after our scan is fine; really gone is not
                missing.append((key, entry.token))
        elif verify_checksums and not _blob_ok(path, entry, verify):
            bad.append((key, entry.token))
    orphans = sorted(n for n, f in disk.items() if n not in expected and f.mtime_ns <= young_after)
    rec_used, used, rec_count, count, lru_bad = index.audit()

    removed: list[str] = []
    if fix:
        # Index first, files second: no entry may point at a file we are about to delete.
        removed = [key for key, _ in index.remove_many(missing + bad)]
        index.rebuild()
        for key, token in bad:
            files.unlink(key, token)
        for name in orphans:
            files.unlink_path(files.root / name)

    report = FsckReport(
        entries=count,
        files=len(disk),
        orphan_files=tuple(orphans),
        missing_files=tuple(k for k, _ in missing),
        bad_checksums=tuple(k for k, _ in bad),
        recorded_used_bytes=rec_used,
        actual_used_bytes=used,
        recorded_entries=rec_count,
        lru_mismatches=lru_bad,
        fixed=fix,
    )
    return report, removed
