"""The LMDB index of the NVMe cache: entries, LRU order, pins, counters. The single source of truth.

Every process on a node that shares a cache directory opens the same LMDB environment in ``<dir>/index/``;
LMDB serialises write transactions across processes and gives readers consistent snapshots without locks.
Sub-databases (keys are the chunk key's UTF-8 bytes unless stated):

``entries``  key -> ``ENTRY`` struct ``<Q16sQ8sB``, 41 bytes: size, checksum (xxh3-128 of the whole blob),
             last access (ns since the epoch), file token (8 random bytes naming the file, see ``files.py``),
             state (always 1 = ready: entries are written only after their file is complete; the field
             leaves room for in-flight reservations without a schema change).
``lru``      8-byte big-endian last access ns + key -> b"". Holds only *evictable* entries: a pinned entry has
             no LRU record, so eviction walks from the oldest record and never has to skip pinned ones.
``pins``     key -> ``<Q`` pin count. Counts exist for keys not (yet) cached, so a pinned prompt admitted
             later is never evicted. Pins persist: they are node-wide state, not per-process leases.
``meta``     ``schema_version`` (``<Q``, currently 1), ``used_bytes`` and ``entries`` (``<Q`` counters kept in
             step with ``entries`` inside every write transaction).

LMDB forbids opening one environment twice in a process, so environments are shared through a process-wide
registry keyed by real path. After ``fork`` the child keeps using the inherited handle: py-lmdb refuses a
second handle on the same files, and closing the inherited one would run ``mdb_env_close``, which clears the
*parent's* reader slots. The one cost: the child's readers are recorded under the parent's pid, so a reader
slot of a child killed mid-read is reclaimed only when the parent exits. Prefer 'spawn' for workers.
"""

from __future__ import annotations

import functools
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import ParamSpec, TypeVar

import lmdb

from kvstore.errors import CacheError

SCHEMA_VERSION = 1
STATE_READY = 1
MAX_KEY_BYTES = 500  # LMDB's key limit is 511 bytes and LRU keys carry an 8-byte prefix
DEFAULT_MAP_SIZE = 64 << 30  # sparse: LMDB only grows the file as pages are used
INDEX_DIR = "index"

_ENTRY = struct.Struct("<Q16sQ8sB")
_U64 = struct.Struct("<Q")
_TS = struct.Struct(">Q")  # big-endian so LMDB's byte order is time order
_SCHEMA_KEY = b"schema_version"
_USED_KEY = b"used_bytes"
_COUNT_KEY = b"entries"

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass(frozen=True)
class Entry:
    """One cached chunk as the index records it."""

    size: int
    checksum: bytes
    last_access_ns: int
    token: bytes
    state: int = STATE_READY

    def pack(self) -> bytes:
        return _ENTRY.pack(self.size, self.checksum, self.last_access_ns, self.token, self.state)

    @classmethod
    def unpack(cls, raw: bytes) -> Entry:
        return cls(*_ENTRY.unpack(raw))


@dataclass(frozen=True)
class Admission:
    """The outcome of ``CacheIndex.admit``; ``victims``: (key, entry) whose files the caller must unlink."""

    admitted: bool
    victims: tuple[tuple[str, Entry], ...] = ()


def encode_key(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise CacheError(f"cache key must be a non-empty str, got {key!r}")
    raw = key.encode()
    if len(raw) > MAX_KEY_BYTES:
        raise CacheError(
            f"cache key is {len(raw)} bytes, longer than the {MAX_KEY_BYTES}-byte limit: {key[:80]!r}..."
        )
    return raw


def _translate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Map LMDB's exceptions to CacheError at this module's edge."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except lmdb.Error as exc:
            raise CacheError(f"cache index error: {exc}") from exc

    return wrapper


@dataclass
class _Shared:
    env: lmdb.Environment
    entries: lmdb._Database
    lru: lmdb._Database
    pins: lmdb._Database
    meta: lmdb._Database
    pid: int
    refs: int = 0


_REGISTRY: dict[str, _Shared] = {}
_REGISTRY_LOCK = threading.Lock()


def _open_shared(path: str, map_size: int, max_readers: int, sync: bool) -> _Shared:
    os.makedirs(path, exist_ok=True)
    env = lmdb.open(path, map_size=map_size, max_dbs=8, max_readers=max_readers, sync=sync, metasync=sync)
    try:
        # Reader slots of SIGKILLed processes would otherwise pin old pages forever.
        env.reader_check()
        shared = _Shared(
            env=env,
            entries=env.open_db(b"entries"),
            lru=env.open_db(b"lru"),
            pins=env.open_db(b"pins"),
            meta=env.open_db(b"meta"),
            pid=os.getpid(),
        )
        _check_schema(shared, path)
    except BaseException:
        env.close()
        raise
    return shared


def _check_schema(shared: _Shared, path: str) -> None:
    with shared.env.begin() as txn:
        raw = txn.get(_SCHEMA_KEY, db=shared.meta)
    if raw is None:
        with shared.env.begin(write=True) as txn:
            if txn.get(_SCHEMA_KEY, db=shared.meta) is not None:
                return  # another process initialised it between our two transactions
            if txn.stat(shared.entries)["entries"]:
                # Entries but no version: an index from before versioning, whose counters and LRU order
                # may be missing. Stamping it here would skip the migration that rebuilds them.
                raise CacheError(
                    f"cache index {path!r} predates schema versioning; run `kvstore migrate` first"
                )
            txn.put(_SCHEMA_KEY, _U64.pack(SCHEMA_VERSION), db=shared.meta)
        return
    version = _U64.unpack(raw)[0]
    if version > SCHEMA_VERSION:
        raise CacheError(
            f"cache index {path!r} has schema version {version}, newer than this kvstore supports "
            f"({SCHEMA_VERSION}); upgrade kvstore or point the cache at another directory"
        )


def _acquire(path: str, map_size: int, max_readers: int, sync: bool) -> _Shared:
    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(path)
        if shared is None:
            shared = _open_shared(path, map_size, max_readers, sync)
            _REGISTRY[path] = shared
        shared.refs += 1
        return shared


def _release(path: str, shared: _Shared) -> None:
    with _REGISTRY_LOCK:
        shared.refs -= 1
        if shared.refs <= 0:
            if _REGISTRY.get(path) is shared:
                del _REGISTRY[path]
            if shared.pid == os.getpid():  # never in a forked child: see the module docstring
                shared.env.close()


def _lru_key(ts: int, key: bytes) -> bytes:
    return _TS.pack(ts) + key


class CacheIndex:
    """The LMDB index of one cache directory. Thread-safe; shareable by processes through LMDB itself."""

    @_translate
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        max_readers: int = 512,
        sync: bool = True,
    ) -> None:
        self.path = os.path.realpath(os.path.join(directory, INDEX_DIR))
        self._shared: _Shared | None = _acquire(self.path, map_size, max_readers, sync)

    def _db(self) -> _Shared:
        shared = self._shared
        if shared is None:
            raise CacheError(f"cache index {self.path!r} is closed")
        return shared

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            _release(self.path, shared)

    # -- reads -------------------------------------------------------------------------------------------

    @_translate
    def get(self, key: str) -> Entry | None:
        s = self._db()
        with s.env.begin() as txn:
            raw = txn.get(encode_key(key), db=s.entries)
        return None if raw is None else Entry.unpack(raw)

    @_translate
    def get_many(self, keys: Iterable[str]) -> list[Entry | None]:
        """Each key's entry (or None), from one snapshot: a load of many chunks reads the index once."""
        s = self._db()
        db = s.entries
        with s.env.begin() as txn:
            get = txn.get
            raws = [get(encode_key(k), db=db) for k in keys]
        return [None if raw is None else Entry.unpack(raw) for raw in raws]

    @_translate
    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        s = self._db()
        db = s.entries
        with s.env.begin() as txn:
            get = txn.get
            return [get(encode_key(k), db=db) is not None for k in keys]

    @_translate
    def pin_count(self, key: str) -> int:
        s = self._db()
        with s.env.begin() as txn:
            raw = txn.get(encode_key(key), db=s.pins)
        return 0 if raw is None else _U64.unpack(raw)[0]

    @_translate
    def counters(self) -> tuple[int, int, int]:
        """(used bytes, entries, resident pinned entries), from one snapshot."""
        s = self._db()
        with s.env.begin() as txn:
            used, count = self._counters(txn, s)
            pinned = sum(1 for k in txn.cursor(db=s.pins).iternext(values=False) if txn.get(k, db=s.entries))
        return used, count, pinned

    def iter_entries(self, batch: int = 1024) -> Iterator[tuple[str, Entry]]:
        """All entries in key order, read in short transactions so no snapshot is held between batches."""
        after: bytes | None = None
        while True:
            rows = self._entry_batch(after, batch)
            if not rows:
                return
            for k, raw in rows:
                yield k.decode(), Entry.unpack(raw)
            after = rows[-1][0]

    @_translate
    def _entry_batch(self, after: bytes | None, batch: int) -> list[tuple[bytes, bytes]]:
        s = self._db()
        rows: list[tuple[bytes, bytes]] = []
        with s.env.begin() as txn:
            cur = txn.cursor(db=s.entries)
            positioned = cur.first() if after is None else cur.set_range(after)
            if positioned and after is not None and cur.key() == after:
                positioned = cur.next()
            while positioned and len(rows) < batch:
                rows.append((cur.key(), cur.value()))
                positioned = cur.next()
        return rows

    # -- writes ------------------------------------------------------------------------------------------

    def admit(self, key: str, entry: Entry, budget: int, touches: Mapping[str, int]) -> Admission:
        """In ONE write transaction: apply buffered touches, insert ``entry`` and evict LRU victims until
        usage <= budget. Not admitted (nothing inserted, nothing evicted) when the key is already present or
        the unpinned entries cannot free enough space. Eviction costs O(victims): every entry is evicted at
        most once per admission, so the work is amortised O(1) per put."""
        return self.admit_many([(key, entry)], budget, touches)[0]

    @_translate
    def admit_many(
        self, items: Sequence[tuple[str, Entry]], budget: int, touches: Mapping[str, int]
    ) -> list[Admission]:
        """`admit` for several entries, in order, in ONE write transaction: one commit (and with `sync`, one
        fsync) for a whole batch instead of one per chunk. A later entry may evict an earlier one of the same
        batch when the budget is that small; its victims say so."""
        s = self._db()
        with s.env.begin(write=True) as txn:
            self._apply_touches(txn, s, touches)
            return [self._admit_one(txn, s, encode_key(key), entry, budget) for key, entry in items]

    def _admit_one(
        self, txn: lmdb.Transaction[bytes], s: _Shared, k: bytes, entry: Entry, budget: int
    ) -> Admission:
        if txn.get(k, db=s.entries) is not None:
            return Admission(False)
        used, count = self._counters(txn, s)
        need = used + entry.size - budget
        victims: list[tuple[bytes, Entry]] = []
        if need > 0:
            victims = self._pick_victims(txn, s, need)
            if sum(v.size for _, v in victims) < need:
                return Admission(False)
        for vk, ve in victims:
            txn.delete(vk, db=s.entries)
            txn.delete(_lru_key(ve.last_access_ns, vk), db=s.lru)
            used -= ve.size
            count -= 1
        txn.put(k, entry.pack(), db=s.entries)
        if txn.get(k, db=s.pins) is None:
            txn.put(_lru_key(entry.last_access_ns, k), b"", db=s.lru)
        self._set_counters(txn, s, used + entry.size, count + 1)
        return Admission(True, tuple((vk.decode(), ve) for vk, ve in victims))

    def _pick_victims(self, txn: lmdb.Transaction[bytes], s: _Shared, need: int) -> list[tuple[bytes, Entry]]:
        victims: list[tuple[bytes, Entry]] = []
        stale: list[bytes] = []
        freed = 0
        for lk in txn.cursor(db=s.lru).iternext(values=False):
            vk = lk[8:]
            raw = txn.get(vk, db=s.entries)
            entry = None if raw is None else Entry.unpack(raw)
            if entry is None or entry.last_access_ns != _TS.unpack(lk[:8])[0] or txn.get(vk, db=s.pins):
                stale.append(lk)  # self-healing: a record that no longer matches an evictable entry
                continue
            victims.append((vk, entry))
            freed += entry.size
            if freed >= need:
                break
        for lk in stale:
            txn.delete(lk, db=s.lru)
        return victims

    @_translate
    def apply_touches(self, touches: Mapping[str, int]) -> None:
        if not touches:
            return
        s = self._db()
        with s.env.begin(write=True) as txn:
            self._apply_touches(txn, s, touches)

    def _apply_touches(self, txn: lmdb.Transaction[bytes], s: _Shared, touches: Mapping[str, int]) -> None:
        for key, ts in touches.items():
            k = key.encode()
            raw = txn.get(k, db=s.entries)
            if raw is None:
                continue
            entry = Entry.unpack(raw)
            if ts <= entry.last_access_ns:
                continue  # another process saw it more recently
            if txn.get(k, db=s.pins) is None:
                txn.delete(_lru_key(entry.last_access_ns, k), db=s.lru)
                txn.put(_lru_key(ts, k), b"", db=s.lru)
            txn.put(k, replace(entry, last_access_ns=ts).pack(), db=s.entries)

    @_translate
    def remove(self, key: str, token: bytes | None = None) -> Entry | None:
        """Drop ``key``'s entry (only if its file token is ``token``, when given); returns the dropped entry.

        The token guard matters when a reader found a file missing: by the time it removes the stale entry,
        another process may have re-admitted the key under a new token, which must survive."""
        k = encode_key(key)
        s = self._db()
        with s.env.begin(write=True) as txn:
            entry = self._remove(txn, s, k, token)
        return entry

    @_translate
    def remove_many(self, items: Iterable[tuple[str, bytes]]) -> list[tuple[str, Entry]]:
        s = self._db()
        removed: list[tuple[str, Entry]] = []
        with s.env.begin(write=True) as txn:
            for key, token in items:
                entry = self._remove(txn, s, key.encode(), token)
                if entry is not None:
                    removed.append((key, entry))
        return removed

    def _remove(
        self, txn: lmdb.Transaction[bytes], s: _Shared, k: bytes, token: bytes | None
    ) -> Entry | None:
        raw = txn.get(k, db=s.entries)
        if raw is None:
            return None
        entry = Entry.unpack(raw)
        if token is not None and entry.token != token:
            return None
        txn.delete(k, db=s.entries)
        txn.delete(_lru_key(entry.last_access_ns, k), db=s.lru)
        used, count = self._counters(txn, s)
        self._set_counters(txn, s, max(0, used - entry.size), max(0, count - 1))
        return entry

    @_translate
    def change_pins(self, keys: Iterable[str], delta: int) -> None:
        """Add ``delta`` (+1 or -1) to each key's pin count; counts never go below zero. A key whose count
        leaves zero loses its LRU record (eviction cannot see it); one that returns to zero gets it back."""
        encoded = [encode_key(k) for k in keys]
        s = self._db()
        with s.env.begin(write=True) as txn:
            for k in encoded:
                raw = txn.get(k, db=s.pins)
                old = 0 if raw is None else _U64.unpack(raw)[0]
                new = max(0, old + delta)
                if new == old:
                    continue
                if new:
                    txn.put(k, _U64.pack(new), db=s.pins)
                else:
                    txn.delete(k, db=s.pins)
                if (old == 0) == (new == 0):
                    continue
                raw_entry = txn.get(k, db=s.entries)
                if raw_entry is None:
                    continue
                lk = _lru_key(Entry.unpack(raw_entry).last_access_ns, k)
                if new:
                    txn.delete(lk, db=s.lru)
                else:
                    txn.put(lk, b"", db=s.lru)

    @_translate
    def rebuild(self) -> tuple[int, int, int, int]:
        """Recompute counters and the LRU database from ``entries`` (fsck's repair of index drift).

        Returns (recorded used bytes, actual used bytes, recorded entries, actual entries) as found."""
        s = self._db()
        with s.env.begin(write=True) as txn:
            rec_used, rec_count = self._counters(txn, s)
            used = count = 0
            txn.drop(s.lru, delete=False)
            for k, raw in txn.cursor(db=s.entries):
                entry = Entry.unpack(raw)
                used += entry.size
                count += 1
                if txn.get(k, db=s.pins) is None:
                    txn.put(_lru_key(entry.last_access_ns, k), b"", db=s.lru)
            self._set_counters(txn, s, used, count)
        return rec_used, used, rec_count, count

    @_translate
    def audit(self) -> tuple[int, int, int, int, int]:
        """Read-only counterpart of ``rebuild``: (recorded used, actual used, recorded entries, actual
        entries, LRU records that do not match exactly one evictable entry)."""
        s = self._db()
        with s.env.begin() as txn:
            rec_used, rec_count = self._counters(txn, s)
            used = count = 0
            expected: set[bytes] = set()
            for k, raw in txn.cursor(db=s.entries):
                entry = Entry.unpack(raw)
                used += entry.size
                count += 1
                if txn.get(k, db=s.pins) is None:
                    expected.add(_lru_key(entry.last_access_ns, k))
            actual = set(txn.cursor(db=s.lru).iternext(values=False))
        return rec_used, used, rec_count, count, len(expected ^ actual)

    def _counters(self, txn: lmdb.Transaction[bytes], s: _Shared) -> tuple[int, int]:
        used = txn.get(_USED_KEY, db=s.meta)
        count = txn.get(_COUNT_KEY, db=s.meta)
        return (
            0 if used is None else _U64.unpack(used)[0],
            0 if count is None else _U64.unpack(count)[0],
        )

    def _set_counters(self, txn: lmdb.Transaction[bytes], s: _Shared, used: int, count: int) -> None:
        txn.put(_USED_KEY, _U64.pack(used), db=s.meta)
        txn.put(_COUNT_KEY, _U64.pack(count), db=s.meta)
