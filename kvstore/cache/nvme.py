"""NVMeCache: the node-local read-through cache of chunk blobs (byte budget, LRU eviction, pins).

It combines ``ChunkFiles`` (bytes on disk) with ``CacheIndex`` (the LMDB index, the single source of truth).
Several processes may open the same directory at once. Ordering rules that keep it crash- and race-safe:

* admit: write a tmp file, rename it to a name unique to this admission, then ONE index transaction inserts
  the entry and evicts victims; victims' files are unlinked only after that commit. A crash before the commit
  leaves an orphan file (fsck removes it), never an index entry pointing at a partial or foreign file.
* remove (discard, stale entry, fsck): index first, file second, for the same reason.
* a reader that finds a file gone lost a race with another process's eviction: it is a miss, and the stale
  entry (if it still names that very file) is dropped.

Blobs are opaque here; their own checksums are verified by whoever decodes them (and by ``fsck``). The index
stores xxh3-128 of the whole blob, computed by ``put``, so fsck can tell corruption even of the header.

Threading: all methods may be called from several threads. ``touch`` and reads only buffer LRU updates in
memory; the buffer is applied in one write transaction by the next ``put``, by ``flush``, when it grows past
``touch_buffer_max`` keys or is older than ``touch_flush_interval_s`` at the next read, and on ``close``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

from kvstore.cache.files import ChunkFiles, new_token
from kvstore.cache.fsck import FsckReport, check
from kvstore.cache.index import DEFAULT_MAP_SIZE, CacheIndex, Entry, encode_key
from kvstore.chunk import checksum
from kvstore.errors import CacheError, ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedChunk:
    """Where a cached chunk lies, for callers that ``open()`` + ``readinto`` themselves. The file can still
    vanish before it is opened (another process evicted it): treat FileNotFoundError as a miss."""

    key: str
    path: str
    size: int


@dataclass(frozen=True)
class CacheUsage:
    used_bytes: int
    budget_bytes: int
    entries: int
    pinned_entries: int


class NVMeCache:
    """A byte-budgeted cache of chunk blobs in ``directory``, shared by every process on the node.

    ``budget_bytes`` applies to the admissions this instance makes; give every process the same value.
    ``fsync`` makes each file durable before its index entry is committed (off by default: a file torn by a
    power loss fails its checksum on read and becomes a miss). ``index_sync`` is LMDB's own commit fsync.
    ``on_evict`` is called (outside any lock, after the commit) with the keys each operation removed: the
    same keys ``take_evicted`` returns.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        budget_bytes: int,
        *,
        fsync: bool = False,
        index_sync: bool = True,
        map_size: int = DEFAULT_MAP_SIZE,
        max_readers: int = 512,
        touch_flush_interval_s: float = 1.0,
        touch_buffer_max: int = 4096,
        on_evict: Callable[[list[str]], None] | None = None,
    ) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ConfigError(f"cache_bytes must be a positive number of bytes, got {budget_bytes!r}")
        self.directory = os.fspath(directory)
        self.budget_bytes = budget_bytes
        self._files = ChunkFiles(directory, fsync=fsync)
        self._index = CacheIndex(directory, map_size=map_size, max_readers=max_readers, sync=index_sync)
        self._on_evict = on_evict
        self._touch_interval_ns = int(touch_flush_interval_s * 1e9)
        self._touch_max = touch_buffer_max
        self._lock = threading.Lock()  # guards the two buffers below, never held across I/O
        self._touches: dict[str, int] = {}
        self._touches_since = time.monotonic_ns()
        self._evicted: list[str] = []
        self._closed = False

    # -- admission ---------------------------------------------------------------------------------------

    def put(self, key: str, blob: bytes | memoryview) -> bool:
        """Admit ``blob`` under ``key``. False when the key is already cached, the blob exceeds the budget,
        or the space cannot be freed because the rest is pinned. Raises CacheError on I/O failure."""
        return self.put_many([(key, blob)])[0]

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> list[bool]:
        """`put` for several blobs: their files first, then ONE index transaction for all of them (a store
        job's chunks cost one commit, not one each). Per item, whether it was admitted."""
        for key, _ in items:
            encode_key(key)
        present = self._index.get_many([key for key, _ in items])
        written: list[tuple[int, str, Entry]] = []  # (item index, key, entry) of files now on disk
        try:
            for i, ((key, blob), known) in enumerate(zip(items, present, strict=True)):
                size = memoryview(blob).nbytes
                if size > self.budget_bytes or known is not None:
                    continue  # cheap early exits before any bytes are written
                entry = Entry(
                    size=size,
                    checksum=checksum(blob, release_gil=True),
                    last_access_ns=time.time_ns(),
                    token=new_token(),
                )
                self._files.write(key, entry.token, blob)
                written.append((i, key, entry))
            admissions = self._index.admit_many(
                [(key, entry) for _, key, entry in written], self.budget_bytes, self._take_touches()
            )
        except BaseException as exc:
            for _, key, entry in written:
                self._files.unlink(key, entry.token)
            if isinstance(exc, OSError):
                raise CacheError(f"cannot write chunk file in {self.directory!r}: {exc}") from exc
            raise
        admitted = [False] * len(items)
        removed: list[str] = []
        for (i, key, entry), admission in zip(written, admissions, strict=True):
            if admission.admitted:
                admitted[i] = True
            else:
                # Lost a race with another process admitting the same key, or no room: our file is nobody's.
                self._files.unlink(key, entry.token)
            for vkey, ventry in admission.victims:
                self._files.unlink(vkey, ventry.token)
                removed.append(vkey)
        self._record_removed(removed)
        return admitted

    # -- lookups -----------------------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The blob, or None on a miss. Counts as a touch."""
        entry = self._index.get(key)
        if entry is None:
            return None
        data = self._files.read(key, entry.token)
        if data is None or len(data) != entry.size:
            self._drop_stale(key, entry)
            return None
        self._touch_one(key)
        return data

    def locate(self, key: str, *, touch: bool = True) -> CachedChunk | None:
        """Where the blob lies, or None on a miss. Counts as a touch unless `touch=False` (a caller on a
        latency-critical path records touches itself, so a due flush never lands in the middle of a load).

        No stat here: this is the load hot path, and the reader must handle a file that vanishes after
        this call anyway (another process may evict it). Readers report such a file with `forget`.
        """
        entry = self._index.get(key)
        if entry is None:
            return None
        if touch:
            self._touch_one(key)
        return CachedChunk(key=key, path=self._files.path_str(key, entry.token), size=entry.size)

    def locate_many(self, keys: Sequence[str]) -> list[CachedChunk | None]:
        """`locate` for many keys from one index snapshot (no touches: the caller records its own)."""
        entries = self._index.get_many(_key_list(keys))
        return [
            None
            if entry is None
            else CachedChunk(key=key, path=self._files.path_str(key, entry.token), size=entry.size)
            for key, entry in zip(keys, entries, strict=True)
        ]

    def forget(self, key: str, path: str) -> None:
        """Drop `key`'s entry if it still names the file at `path`, which a reader found missing or torn."""
        entry = self._index.get(key)
        if entry is not None and self._files.path_str(key, entry.token) == path:
            self._drop_stale(key, entry)

    def contains(self, key: str) -> bool:
        return self._index.contains_many((key,))[0]

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        """Presence of each key, from one index snapshot. Does not count as a touch."""
        return self._index.contains_many(_key_list(keys))

    def keys(self) -> Iterator[str]:
        """Every cached key, in key order, read in batches (no long-lived snapshot)."""
        for key, _ in self._index.iter_entries():
            yield key

    def usage(self) -> CacheUsage:
        used, entries, pinned = self._index.counters()
        return CacheUsage(
            used_bytes=used, budget_bytes=self.budget_bytes, entries=entries, pinned_entries=pinned
        )

    # -- LRU, removal, pins ------------------------------------------------------------------------------

    def touch(self, keys: Iterable[str]) -> None:
        """Mark keys as used now. Buffered in memory; see the module docstring for when it is applied."""
        now = time.time_ns()
        with self._lock:
            for key in _key_list(keys):
                self._touches[key] = now
        self._maybe_flush()

    def flush(self) -> None:
        """Apply buffered touches now."""
        touches = self._take_touches()
        if touches:
            self._index.apply_touches(touches)

    def discard(self, key: str) -> bool:
        """Remove ``key`` (e.g. its checksum failed). True if it was cached. Not reported by ``take_evicted``:
        the caller asked for it and emits its own event."""
        entry = self._index.remove(key)
        if entry is None:
            return False
        self._files.unlink(key, entry.token)
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

    def take_evicted(self) -> list[str]:
        """Keys this process removed from the index on its own since the last call: evictions, entries whose
        file had vanished or was torn, fsck repairs (not ``discard``). Emit a BlockRemoved event for each."""
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    # -- maintenance -------------------------------------------------------------------------------------

    def fsck(
        self, fix: bool = False, verify_checksums: bool = True, *, orphan_min_age_s: float = 0.0
    ) -> FsckReport:
        """Reconcile index and files; see ``kvstore.cache.fsck``. On a cache other processes are writing,
        pass ``orphan_min_age_s`` (e.g. 60) so files of admissions in flight are not taken for orphans."""
        self.flush()
        report, removed = check(
            self._index,
            self._files,
            fix=fix,
            verify_checksums=verify_checksums,
            orphan_min_age_s=orphan_min_age_s,
        )
        self._record_removed(removed)
        return report

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
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
        if self._index.remove(key, entry.token) is not None:
            self._files.unlink(key, entry.token)  # a torn file (size mismatch) is still there
            self._record_removed([key])

    def _touch_one(self, key: str) -> None:
        now = time.time_ns()
        with self._lock:
            self._touches[key] = now
        self._maybe_flush()

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

    def _record_removed(self, keys: list[str]) -> None:
        if not keys:
            return
        with self._lock:
            self._evicted.extend(keys)
        if self._on_evict is not None:
            try:
                self._on_evict(keys)
            except Exception:
                # The removal is committed; a failing observer must not turn it into an error for the caller.
                log.exception("on_evict callback failed for %d keys", len(keys))


def _key_list(keys: Iterable[str]) -> list[str]:
    # A bare str is one key, not an iterable of one-character keys.
    return [keys] if isinstance(keys, str) else list(keys)
