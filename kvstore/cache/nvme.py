"""NVMeCache: the node-local read-through cache of chunks (byte budget, LRU eviction, pins, upload journal).

It combines ``ChunkFiles`` (bytes on disk) with ``CacheIndex`` (the LMDB index, the single source of truth).
Several processes open the same directory at once: the vLLM engines of the node (loads and stores), the node
agent (uploads, admission of object hits, eviction, touches) and the tools. Ordering rules that keep it crash-
and race-safe:

* admit: write a tmp file, rename it to a name unique to this admission (``write_file``), then ONE index
  transaction inserts the entries and, only if the budget is exceeded, evicts victims (``commit``); victims'
  files are unlinked only after that commit. A crash before the commit leaves a tmp file (``reclaim_tmp`` at
  the next open removes it) or a file no entry names (fsck's), never an entry naming a partial or foreign
  file.
* evict: the node agent keeps usage below the budget (``evict``), so the data path's commits rarely evict.
* remove (discard, stale entry, fsck): index first, file second, for the same reason.
* the transaction that drops an entry names its file in the index (``unlinks.py``) until the file is
  deleted, so a process killed in between (thousands of files, mid-eviction) leaves nothing behind: the next
  open deletes them, reading only that short list.
* a reader that finds a file gone lost a race with another process's eviction: it is a miss, and the stale
  entry (if it still names that very file) is dropped by ``forget``.

The budget is ``budget_bytes`` or less, where the disk has less room, and a full disk makes the cache evict,
never stop caching (``room.py``); nothing that only records figures or hints (touches, counters, trimming)
fails for want of room.

Reads verify against the index alone (``reading.py``).

The upload journal: a chunk admitted with ``pending_upload`` is recorded as not yet in the object store.
Uploaders ``claim_uploads`` (a lease by the node's boot clock, taken over at once when its holder died), read
the file (``read_stored``) and ``finish_uploads``. A pending chunk that leaves the cache first is counted
lost exactly once for the node (the index's ``uploads_lost`` counter), by the transaction that settles it;
each process learns its own share by reason (``take_removals``, with the evictions this process made).
Evictions, removals and finished uploads are appended to the node's change log (``changes_since``), from
which every engine on the node makes its KV events.

Threading: all methods may be called from several threads. ``touch`` only buffers LRU updates in memory; the
buffer is applied in one write transaction by the next commit, by ``flush``, when it grows past
``touch_buffer_max`` keys or is older than ``touch_flush_interval_s`` at the next touch, and on ``close``.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from types import TracebackType

from kvstore.cache.changelog import MAX_CHANGES, TRIM_SLICE
from kvstore.cache.claims import clock_ns
from kvstore.cache.files import ChunkFiles, new_token
from kvstore.cache.fsck import FsckReport, check, open_recovering
from kvstore.cache.index import CacheIndex
from kvstore.cache.index_flush import DEFAULT_FLUSH_S
from kvstore.cache.lmdb_env import DEFAULT_MAP_SIZE
from kvstore.cache.reading import read_into, read_stored
from kvstore.cache.records import (
    MAX_KEY_BYTES,
    Backlog,
    CachedChunk,
    CacheUsage,
    Change,
    Entry,
    ReadResult,
    Removals,
    StagedFile,
    encode_key,
)
from kvstore.cache.room import Room
from kvstore.chunk import (
    Buffer,
    ChunkHeader,
)
from kvstore.errors import CacheError, CacheFull, ConfigError, KVStoreError

log = logging.getLogger(__name__)

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class NVMeCache:
    """A byte-budgeted cache of chunks in ``directory``, shared by every process on the node.

    ``budget_bytes`` applies to the admissions this instance makes; give every process the same value.
    ``fsync`` makes each file durable before its index entry is committed (off by default: a file torn by a
    power loss fails its checksum on read and becomes a miss). ``index_flush_s`` is how often the index's
    commits are made durable together (0: LMDB syncs each commit; see `kvstore.cache.index_flush`).
    ``change_log_max`` bounds the node's change log (every process's commits keep it there).
    ``direct_io`` uses O_DIRECT where the filesystem allows it (for reads alone with ``direct_writes``
    False); ``repair`` opens for fsck only (it works on a full disk: nothing is written to open it).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        budget_bytes: int,
        *,
        fsync: bool = False,
        index_flush_s: float = DEFAULT_FLUSH_S,
        direct_io: bool = True,
        direct_writes: bool = True,
        repair: bool = False,
        map_size: int = DEFAULT_MAP_SIZE,
        max_readers: int = 512,
        touch_flush_interval_s: float = 1.0,
        touch_buffer_max: int = 4096,
        change_log_max: int = MAX_CHANGES,
    ) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ConfigError(f"cache_bytes must be a positive number of bytes, got {budget_bytes!r}")
        self.directory = os.fspath(directory)
        self.budget_bytes = budget_bytes
        self._files = ChunkFiles(
            directory, fsync=fsync, direct_io=direct_io, direct_writes=direct_writes, repair=repair
        )
        self._index = open_recovering(
            self.directory,
            lambda: CacheIndex(
                directory,
                map_size=map_size,
                max_readers=max_readers,
                flush_s=index_flush_s,
                change_log_max=change_log_max,
            ),
        )
        self._room = Room(self.directory, budget_bytes, self._index)
        self._touch_interval_ns = int(touch_flush_interval_s * 1e9)
        self._touch_max = touch_buffer_max
        self._lock = threading.Lock()  # guards the buffers below, never held across I/O
        self._touches: dict[str, int] = {}
        self._touches_since = time.monotonic_ns()
        self._evicted = 0
        self._closed = False
        reclaimed = self._files.reclaim_tmp()
        if reclaimed.files:
            log.info(
                "removed %d unfinished chunk files (%d bytes) left by writers that are gone",
                reclaimed.files,
                reclaimed.bytes,
            )
        self._delete_unlinked()
        if not repair:
            self._room.keep_ballast()
            self._room.warn_if_disk_is_smaller()

    @property
    def direct_io(self) -> bool:
        """Whether chunk files bypass the page cache (O_DIRECT) here."""
        return self._files.direct_io

    # -- admission ---------------------------------------------------------------------------------------

    def write_file(self, header: ChunkHeader, parts: Sequence[Buffer]) -> StagedFile:
        """Write one chunk's file (``parts`` concatenated are the whole chunk: header block, payload,
        padding), not yet indexed. Thread-safe; raises CacheFull when the filesystem has no room (make room
        with ``make_room``, then try again), CacheError on any other I/O failure."""
        if header.total_length > self.budget_bytes:
            raise CacheError(f"chunk {header.key} ({header.total_length} bytes) exceeds the cache budget")
        entry = Entry(
            size=header.total_length,
            checksum=header.checksum,
            last_access_ns=time.time_ns(),
            token=new_token(),
            codec=int(header.codec),
            raw_length=header.raw_length,
        )
        try:
            path = self._files.write(header.key, entry.token, parts)
        except OSError as exc:
            error = CacheFull if exc.errno in _NO_SPACE else CacheError
            raise error(f"cannot write chunk file in {self.directory!r}: {exc}") from exc
        return StagedFile(header.key, entry, path)

    def commit(self, staged: Sequence[StagedFile], *, pending_upload: bool = False) -> list[bool]:
        """Index written files in ONE transaction (a store job's chunks cost one commit, not one each);
        per file, whether it was admitted. A file not admitted (the key is already cached, or no room
        because the rest is pinned) is removed. With ``pending_upload`` the chunks join the upload journal.
        Evicts only what the budget requires (the node agent usually has made room already).
        """
        queued = time.time_ns() if pending_upload else 0
        items = [(s.key, _queued(s.entry, queued)) for s in staged]
        try:
            for item in staged:
                encode_key(item.key)  # a key the index cannot hold: the batch fails, and its files go
            budget = self.effective_budget(written_bytes=sum(s.entry.size for s in staged))
            admissions = self._index.admit_many(items, budget, self._take_touches())
        except BaseException:
            self.abandon(staged)
            raise
        admitted = [False] * len(staged)
        for i, (item, admission) in enumerate(zip(staged, admissions, strict=True)):
            if admission.admitted:
                admitted[i] = True
            else:
                # Lost a race with another process admitting the same key, or no room: our file is nobody's.
                self._files.unlink_path(item.path)
            self._unlink(admission.victims)
        self._count_evicted(sum(len(a.victims) for a in admissions))
        return admitted

    def abandon(self, staged: Iterable[StagedFile]) -> None:
        """Remove written files that will not be committed."""
        for item in staged:
            self._files.unlink_path(item.path)

    # -- room --------------------------------------------------------------------------------------------

    def effective_budget(self, *, written_bytes: int = 0) -> int:
        """What the cache may hold now (``room.py``): ``budget_bytes``, or less where its filesystem has less
        room; ``written_bytes``: files written and not yet committed."""
        return self._room.effective_budget(written_bytes)

    def evict(self, target_bytes: int, *, keep_pending: bool = False) -> list[str]:
        """Evict least recently used chunks (uploaded ones first; never pinned ones, nor, with
        ``keep_pending``, ones still waiting for upload) until the cache holds at most ``target_bytes``; the
        keys evicted. The node agent's job; also the way out of a full disk. CacheError when the disk is so
        full that not even the ballast's room lets the index commit."""
        self.flush()  # the touches buffered here count: what was just used stays
        eviction = self._room.evict(target_bytes, keep_pending)
        self._unlink(eviction.victims)
        self._count_evicted(len(eviction.victims))
        self._room.keep_ballast()
        return [key for key, _ in eviction.victims]

    def make_room(self, nbytes: int) -> list[str]:
        """Evict so that ``nbytes`` more fit in the effective budget (after a write found the disk full);
        the keys evicted. Never raises: where nothing can be evicted the write that needed room fails."""
        try:
            evicted = self.evict(self.effective_budget() - nbytes)
            if evicted and self.effective_budget() - nbytes < self.used_bytes():
                evicted += self.evict(self.effective_budget() - nbytes)  # a first slice, on a full disk
        except KVStoreError as exc:
            log.warning("cannot make room in the NVMe cache: %s", exc)
            return []
        return evicted

    # -- reads -------------------------------------------------------------------------------------------

    def read_into(self, located: CachedChunk, dest: memoryview) -> ReadResult:
        """Read and verify the chunk into ``dest`` (exactly its raw length); see ``reading.read_into``. On
        CORRUPT the caller discards, on GONE or REPLACED it ``forget``s."""
        return read_into(self._files, located, dest)

    def read_stored(self, located: CachedChunk) -> memoryview:
        """The whole chunk file as stored (what an upload PUTs); see ``reading.read_stored``."""
        return read_stored(self._files, located)

    def locate_many(self, keys: Sequence[str]) -> list[CachedChunk | None]:
        """`locate` for many keys from one index snapshot (no touches: the caller records its own)."""
        entries = self._index.get_many(_key_list(keys))
        return [
            None if entry is None else self._located(key, entry)
            for key, entry in zip(keys, entries, strict=True)
        ]

    def _located(self, key: str, entry: Entry) -> CachedChunk:
        return CachedChunk(
            key=key,
            path=self._files.path_str(key, entry.token),
            size=entry.size,
            checksum=entry.checksum,
            codec=entry.codec,
            raw_length=entry.raw_length,
            pending_upload=entry.pending_upload,
        )

    def forget(self, key: str, path: str) -> None:
        """Drop `key`'s entry if it still names the file at `path`, which a reader found missing or torn."""
        entry = self._entry_naming(key, path)
        if entry is not None:
            self._drop_stale(key, entry)

    def _entry_naming(self, key: str, path: str) -> Entry | None:
        """`key`'s entry if it still names the file at `path` (not one stored again since)."""
        entry = self._index.get(key)
        return entry if entry is not None and self._files.path_str(key, entry.token) == path else None

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        """Presence of each key, from one index snapshot. Does not count as a touch."""
        return self._index.contains_many(_key_list(keys))

    def used_bytes(self) -> int:
        """Bytes the cache holds (one index read; ``usage`` also counts pinned entries)."""
        return self._index.used_bytes()

    def keeps_for_s(self, incoming_bytes: int) -> float | None:
        """How long this cache keeps a chunk now: the seconds since the chunk that ``incoming_bytes`` more
        would evict first was last used; None when they fit without evicting anything."""
        if self.used_bytes() + incoming_bytes <= self.effective_budget():
            return None
        oldest = self._index.oldest_access_ns()
        return None if oldest is None else max(0.0, (time.time_ns() - oldest) / 1e9)

    def usage(self) -> CacheUsage:
        used, entries, pinned = self._index.counters()
        return CacheUsage(
            used_bytes=used, budget_bytes=self.budget_bytes, entries=entries, pinned_entries=pinned
        )

    # -- node-wide counters ------------------------------------------------------------------------------

    def add_counters(self, deltas: Mapping[str, int]) -> None:
        """Add this process's increments to the node's counters (every process on the node adds its own).
        Figures only: on a full disk they are dropped."""
        try:
            self._index.add_counters({k: v for k, v in deltas.items() if v})
        except CacheFull as exc:
            log.debug("node counters dropped: %s", exc)

    def counters(self) -> dict[str, int]:
        """The node's counters: the sum of what every process on the node added."""
        return self._index.read_counters()

    # -- the upload journal ------------------------------------------------------------------------------

    def claim_uploads(self, limit: int, *, lease_s: float = 60.0) -> list[CachedChunk]:
        """Up to ``limit`` chunks waiting for upload, oldest first, held by this process for ``lease_s`` (or
        until it dies: another process then takes them over at once)."""
        claimed = self._index.claim_uploads(limit, clock_ns(), int(lease_s * 1e9))
        return [self._located(key, entry) for key, entry in claimed]

    def finish_uploads(
        self,
        done: Iterable[str],
        failed: Iterable[str] = (),
        retry_in_s: float = 0.0,
        *,
        gone: Iterable[str] = (),
    ) -> list[str]:
        """Mark chunks uploaded; make failed ones claimable again after ``retry_in_s``; ``gone``: claimed
        chunks that will never be uploaded (their file went, or was damaged). Returns the chunks counted
        lost now: those that left the cache while claimed and did not make it (``take_removals`` counts them
        too)."""
        return self._index.finish_uploads(done, failed, clock_ns() + int(retry_in_s * 1e9), gone)

    def backlog(self) -> Backlog:
        """Chunks, bytes and the oldest queue time of what waits for upload (every process's)."""
        return self._index.backlog()

    def take_removals(self) -> Removals:
        """What this process's calls removed since the last call: chunks evicted, and chunks that left the
        cache before their upload, by reason (``evicted``, ``discarded``, ``fsck``, ``lost``)."""
        with self._lock:
            evicted, self._evicted = self._evicted, 0
        lost = self._index.take_lost()
        return Removals(evicted, {reason: n for reason, n in lost.items() if n})

    # -- LRU, removal, pins ------------------------------------------------------------------------------

    def touch(self, keys: Iterable[str]) -> None:
        """Mark keys as used now. Buffered in memory; see the module docstring for when it is applied. Keys
        the index cannot hold (empty, too long: they come from hints anyone on the node may send) are
        ignored."""
        now = time.time_ns()
        with self._lock:
            for key in _key_list(keys):
                if key and len(key.encode()) <= MAX_KEY_BYTES:
                    self._touches[key] = now
        self._maybe_flush()

    def flush(self) -> None:
        """Apply buffered touches now (dropped on a full disk: they only order evictions)."""
        touches = self._take_touches()
        if touches:
            try:
                self._index.apply_touches(touches)
            except CacheFull as exc:
                log.debug("%d touches dropped: %s", len(touches), exc)

    def discard(self, key: str, *, path: str | None = None) -> bool:
        """Remove ``key`` (e.g. its checksum failed); with ``path``, only while its entry still names that
        file (a copy stored again since is another file, and stays). True if it was removed."""
        if path is None:
            entry = self._index.remove(key, reason="discarded")
        else:
            held = self._entry_naming(key, path)
            entry = None if held is None else self._index.remove(key, held.token, reason="discarded")
        if entry is None:
            return False
        self._unlink([(key, entry)])
        return True

    def pin(self, keys: Iterable[str]) -> None:
        """Add one pin to each key, cached or not; a key with pins is never evicted."""
        self._index.change_pins(_key_list(keys), +1)

    def unpin(self, keys: Iterable[str]) -> None:
        """Remove one pin from each key (a key without pins is left alone)."""
        self._index.change_pins(_key_list(keys), -1)

    def pinned(self, key: str) -> int:
        """The key's pin count."""
        return self._index.pin_count(key)

    # -- the change log ----------------------------------------------------------------------------------

    def change_seq(self) -> int:
        """Where a new reader of the change log starts (no history is replayed)."""
        return self._index.change_seq()

    def changes_since(self, seq: int, limit: int = 4096) -> list[Change]:
        """The node's evictions, removals and finished uploads numbered ``seq`` or later, oldest first."""
        return self._index.changes_since(seq, limit)

    def trim_changes(self, keep: int) -> int:
        """Drop all but the newest ``keep`` changes (the node agent does, now and then), a slice per
        transaction so that no store waits long for the index; how many went."""
        dropped = 0
        try:
            while (n := self._index.trim_changes(keep)) == TRIM_SLICE:
                dropped += n
        except CacheFull:
            return dropped  # the disk is full: trimmed another time
        return dropped + n

    # -- maintenance -------------------------------------------------------------------------------------

    def fsck(
        self, fix: bool = False, verify_checksums: bool = True, *, orphan_min_age_s: float = 0.0
    ) -> FsckReport:
        """Reconcile index and files; see ``kvstore.cache.fsck``. On a cache other processes are writing,
        pass ``orphan_min_age_s`` (e.g. 60) so files of admissions in flight are not taken for orphans."""
        self.flush()
        report, _ = check(
            self._index,
            self._files,
            fix=fix,
            verify_checksums=verify_checksums,
            orphan_min_age_s=orphan_min_age_s,
        )
        return report

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._files.close()
            self._index.close()

    def __enter__(self) -> NVMeCache:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------------------

    def _drop_stale(self, key: str, entry: Entry) -> None:
        # Token-guarded: if another process re-admitted the key meanwhile, its new entry survives.
        if self._index.remove(key, entry.token, reason="lost") is not None:
            self._unlink([(key, entry)])  # a torn file (size mismatch) is still there

    def _unlink(self, dropped: Sequence[tuple[str, Entry]]) -> None:
        """Delete the files of entries a committed transaction dropped."""
        for key, entry in dropped:
            self._files.unlink(key, entry.token)
        self._index.unlinked((key, entry.token) for key, entry in dropped)

    def _delete_unlinked(self) -> None:
        """Delete the files whose entries were dropped by a process killed before it deleted them."""
        try:
            left = self._index.pending_unlinks()
            for key, token in left:
                self._files.unlink(key, token)
            self._index.unlinked(left)
            self._index.forget_unlinked()
        except CacheError as exc:  # a full disk: they are deleted, and named again at the next open
            log.warning("could not record the deletion of dropped chunk files: %s", exc)
            return
        if left:
            log.info("deleted %d chunk files whose entries a process that is gone had dropped", len(left))

    def _maybe_flush(self) -> None:
        with self._lock:
            due = len(self._touches) >= self._touch_max or (
                time.monotonic_ns() - self._touches_since >= self._touch_interval_ns
            )
        if due:
            self.flush()

    def _take_touches(self) -> dict[str, int]:
        with self._lock:
            touches, self._touches = self._touches, {}
            self._touches_since = time.monotonic_ns()
        return touches

    def _count_evicted(self, n: int) -> None:
        with self._lock:
            self._evicted += n


def _queued(entry: Entry, queued_ns: int) -> Entry:
    return replace(entry, queued_ns=queued_ns) if queued_ns else entry


def _key_list(keys: Iterable[str]) -> list[str]:
    # A bare str is one key, not an iterable of one-character keys.
    return [keys] if isinstance(keys, str) else list(keys)
