"""fsck for the NVMe cache: reconcile the LMDB index with the files on disk, optionally repair.

Findings:
* orphan files: on disk but named by no index entry (leftovers of crashed writers, stale tmp files,
  stray files);
* missing files: indexed, but the file is gone;
* bad checksums: the file's size differs from the entry, or the chunk fails ``kvstore.chunk.verify`` as
  its key's chunk, or its content checksum differs from the entry's;
* drift: the usage/entry counters or the LRU database disagree with the entries.

Repair (``fix=True``) drops entries of missing and bad files (index first), rebuilds counters and LRU order,
and only then deletes bad and orphan files. The report describes what was found; a second run is clean.

A damaged index (``CacheIndex`` refuses to open it) is rebuilt by ``rebuild_index`` from the chunk files
themselves: every file names its key in its header. The old index is kept aside, and every rebuilt chunk is
queued for upload again (whether it had been uploaded was recorded only in the lost index; uploading
content-addressed data twice is harmless). Pins come back with the next pin sync from the bucket.

Races with live writers: the disk is scanned *before* the index is read, so a file renamed and committed in
between is either unseen or indexed; a missing file is re-checked before it is reported. A file renamed but
not yet committed looks like an orphan; ``orphan_min_age_s`` spares young files for that reason. Deleting one
anyway is safe: its entry then points at nothing, which readers treat as a miss and clean up.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstore.cache.files import CHUNKS_DIR, ChunkFiles
from kvstore.cache.index import CacheIndex
from kvstore.cache.lmdb_env import INDEX_DIR
from kvstore.cache.records import Entry
from kvstore.chunk import HEADER_BLOCK, ChunkHeader, parse_header, verify
from kvstore.errors import ChunkError, IndexSuspect

log = logging.getLogger(__name__)

REBUILD_LOCK = "index.lock"  # in the cache directory: held shared by opens, exclusive by a rebuild


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
    lost_uploads: int = 0  # removed entries whose chunk had not reached the object store

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
            "lost_uploads": self.lost_uploads,
        }


def _default_verifier() -> Callable[[str, bytes], ChunkHeader]:
    return verify


def _blob_ok(key: str, path: str, entry: Entry, check_chunk: Callable[[str, bytes], ChunkHeader]) -> bool:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return True  # evicted while we looked: not corruption
    if len(data) != entry.size:
        return False
    try:
        return check_chunk(key, data).checksum == entry.checksum
    except ChunkError:
        return False


def check(
    index: CacheIndex,
    files: ChunkFiles,
    *,
    fix: bool = False,
    verify_checksums: bool = True,
    orphan_min_age_s: float = 0.0,
    verify_chunk: Callable[[str, bytes], ChunkHeader] | None = None,
) -> tuple[FsckReport, list[str]]:
    """Run fsck; returns the report and the keys whose entries a repair removed."""
    check_chunk = verify_chunk or _default_verifier()
    # A commit a killed writer left unpublished would otherwise make its file look like an orphan, deleted
    # by a repair just before the commit shows (the next write publishes it): an entry without its file.
    index.catch_up()
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
        elif verify_checksums and not _blob_ok(key, path, entry, check_chunk):
            bad.append((key, entry.token))
    orphans = sorted(n for n, f in disk.items() if n not in expected and f.mtime_ns <= young_after)
    rec_used, used, rec_count, count, lru_bad = index.audit()

    removed: list[str] = []
    lost = 0
    if fix:
        # Orphans first: no entry names them, so removing them is safe at any point, and on a full disk it
        # frees the room the index needs for the commits below.
        for name in orphans:
            files.unlink_path(files.root / name)
        # Index, then files: no entry may point at a file we are about to delete.
        dropped = index.remove_many(missing + bad)
        removed = [key for key, _ in dropped]
        lost = sum(entry.pending_upload for _, entry in dropped)
        index.rebuild()
        for key, token in bad:
            files.unlink(key, token)
        index.unlinked((key, entry.token) for key, entry in dropped)

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
        lost_uploads=lost,
    )
    return report, removed


@dataclass(frozen=True)
class RebuildReport:
    kept_aside: str  # where the damaged index now lies
    entries: int
    bytes: int
    skipped_files: int  # not a valid chunk (removed)


def rebuild_index(directory: str | os.PathLike[str], *, batch: int = 512) -> RebuildReport:
    """Replace a damaged index with one rebuilt from the chunk files (see the module docstring). The cache
    must not be open anywhere while this runs."""
    root = Path(directory)
    old = root / INDEX_DIR
    aside = root / f"{INDEX_DIR}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
    if old.exists():
        old.rename(aside)
    files = ChunkFiles(root, repair=True)
    index = CacheIndex(root)
    entries = nbytes = skipped = 0
    pending: list[tuple[str, Entry]] = []
    queued = time.time_ns()
    try:
        for found in files.scan():
            if found.is_tmp or not found.name.startswith(CHUNKS_DIR + "/"):
                continue
            path = str(root / found.name)
            entry = _entry_from_file(files, path, found.name, queued)
            if entry is None:
                files.unlink_path(path)
                skipped += 1
                continue
            pending.append(entry)
            if len(pending) >= batch:
                entries, nbytes = _admit_rebuilt(files, index, pending, entries, nbytes)
                pending = []
        entries, nbytes = _admit_rebuilt(files, index, pending, entries, nbytes)
    finally:
        index.close()
    log.warning(
        "rebuilt the cache index of %s from %d chunk files; the damaged one is %s", root, entries, aside
    )
    return RebuildReport(kept_aside=str(aside), entries=entries, bytes=nbytes, skipped_files=skipped)


def open_recovering(directory: str | os.PathLike[str], open_index: Callable[[], CacheIndex]) -> CacheIndex:
    """``open_index()``, after rebuilding the index from the chunk files if a machine crash may have damaged
    it (`IndexSuspect`). Opens wait while a rebuild runs (a shared lock against its exclusive one), and of
    several processes that find the index suspect, one rebuilds and the others open what it built."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(directory, REBUILD_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:  # a full disk or a read-only one: no lock to take, and a suspect index stays refused
        return open_index()
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            return open_index()
        except IndexSuspect as exc:
            log.warning("%s", exc)
        fcntl.flock(fd, fcntl.LOCK_EX)  # converting lets another rebuilder in first: then we open its work
        try:
            return open_index()
        except IndexSuspect:
            report = rebuild_index(directory)
            log.warning(
                "rebuilt the cache index: %d chunks kept, %d files dropped",
                report.entries,
                report.skipped_files,
            )
        return open_index()
    finally:
        os.close(fd)  # releases the lock


def _entry_from_file(files: ChunkFiles, path: str, name: str, queued_ns: int) -> tuple[str, Entry] | None:
    """The index entry a chunk file stands for, or None if it is not a whole, valid chunk under its name."""
    token_hex = name.rsplit(".", 1)[-1]
    try:
        token = bytes.fromhex(token_hex)
        with open(path, "rb") as f:
            data = f.read()
        header = parse_header(data[:HEADER_BLOCK])
        if files.relpath(header.key, token) != name:
            return None  # a file under another key's name
        verify(header.key, data)
    except (ValueError, OSError, ChunkError):
        return None
    return header.key, Entry(
        size=header.total_length,
        checksum=header.checksum,
        last_access_ns=time.time_ns(),
        token=token,
        codec=int(header.codec),
        raw_length=header.raw_length,
        queued_ns=queued_ns,
    )


def _admit_rebuilt(
    files: ChunkFiles, index: CacheIndex, items: list[tuple[str, Entry]], entries: int, nbytes: int
) -> tuple[int, int]:
    if not items:
        return entries, nbytes
    for (key, entry), admission in zip(items, index.admit_many(items, 1 << 62, {}), strict=True):
        if admission.admitted:
            entries += 1
            nbytes += entry.size
        else:
            files.unlink(key, entry.token)  # a second file of a key already rebuilt
    return entries, nbytes
