"""The LMDB index of the NVMe cache: entries, LRU order, pins and counters, and the transactions that change
them. The single source of truth.

Every process on a node that shares a cache directory opens the same LMDB environment in ``<dir>/index/``;
LMDB serialises write transactions across processes and gives readers consistent snapshots without locks.
Sub-databases (keys are the chunk key's UTF-8 bytes unless stated):

``entries``  key -> ``ENTRY`` struct ``<Q16sQ8sBBQQ``, 58 bytes: file size, the chunk's content checksum (from
             its header: xxh3-128 over key and raw bytes, so a read verifies against the index alone), last
             access (ns since the epoch), file token (8 random bytes naming the file, see ``files.py``), state
             (always 1 = ready: entries are written only after their file is complete), codec, raw length,
             and the time it was queued for upload (0: the object store has it, or there is none).
``lru``,     the LRU order of evictable entries and the pin counts (``lru.py``).
``pins``
``uploads``  the upload journal (``journal.py``): what waits for upload, oldest first, and who holds it.
``counters`` name -> ``<Q``: node-wide figures (lookups, hits, bytes per tier...) that every process on the
             node adds its own to, so a tool sees the node's traffic, not its own (``add_counters``).
``changes``  the node's change log (``changelog.py``): every transaction that evicts, removes or finishes
             uploading a chunk appends to it, and each engine turns it into KV events.
``unlinks``  the files of dropped entries not deleted yet (``unlinks.py``): whoever opens the cache next
             deletes what a killed process left.
``meta``     ``schema_version`` (``<Q``, currently 2), and counters each module above keeps in step.

What one transaction does to an entry coming in or going out is ``entries.py``'s; opening the environment
(once per process, its schema and data file checked) is ``lmdb_env.py``'s; the values stored and returned
are in ``records.py``. This class opens the transactions and keeps what a process carries between them.
"""

from __future__ import annotations

import collections
import contextlib
import os
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence

import lmdb

from kvstore.cache import changelog, entries, journal, lru, unlinks
from kvstore.cache.claims import Holder, Liveness, clock_ns, this_process
from kvstore.cache.lmdb_env import DEFAULT_MAP_SIZE, INDEX_DIR, Shared, acquire, get_u64, release, translate
from kvstore.cache.records import Admission, Backlog, Change, ChangeKind, Entry, Eviction, encode_key
from kvstore.errors import CacheClosed, CacheError

_U64 = struct.Struct("<Q")


class CacheIndex:
    """The LMDB index of one cache directory. Thread-safe; shareable by processes through LMDB itself."""

    @translate
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        max_readers: int = 512,
        flush_s: float = 0.0,
        change_log_max: int = changelog.MAX_CHANGES,
    ) -> None:
        """``flush_s``: 0, LMDB syncs each commit; more, commits are made durable together that often
        (`kvstore.cache.index_flush`). ``change_log_max``: the most changes the log holds (the oldest go
        first)."""
        self.path = os.path.realpath(os.path.join(directory, INDEX_DIR))
        self._change_log_max = change_log_max
        self._unlinked: list[bytes] = []  # files this process deleted, forgotten by its next write
        self._unlinked_lock = threading.Lock()
        self._lost: collections.Counter[str] = collections.Counter[str]()  # this process's share, by reason
        self._shared: Shared | None = acquire(self.path, map_size, max_readers, flush_s)

    def _db(self) -> Shared:
        shared = self._shared
        if shared is None:
            raise CacheClosed(f"cache index {self.path!r} is closed")
        return shared

    def close(self) -> None:
        if self._shared is not None:
            with contextlib.suppress(CacheError):  # a full disk: the next open deletes them again
                self.forget_unlinked()
        shared, self._shared = self._shared, None
        if shared is not None:
            release(self.path, shared)

    # -- reads -------------------------------------------------------------------------------------------

    @translate
    def get(self, key: str) -> Entry | None:
        s = self._db()
        with s.env.begin() as txn:
            raw = txn.get(encode_key(key), db=s.entries)
        return None if raw is None else Entry.unpack(raw)

    @translate
    def get_many(self, keys: Iterable[str]) -> list[Entry | None]:
        """Each key's entry (or None), from one snapshot: a load of many chunks reads the index once."""
        s = self._db()
        db = s.entries
        with s.env.begin() as txn:
            get = txn.get
            raws = [get(encode_key(k), db=db) for k in keys]
        return [None if raw is None else Entry.unpack(raw) for raw in raws]

    @translate
    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        s = self._db()
        db = s.entries
        with s.env.begin() as txn:
            get = txn.get
            return [get(encode_key(k), db=db) is not None for k in keys]

    @translate
    def pin_count(self, key: str) -> int:
        s = self._db()
        with s.env.begin() as txn:
            return lru.pin_count(txn, s, encode_key(key))

    @translate
    def used_bytes(self) -> int:
        s = self._db()
        with s.env.begin() as txn:
            return entries.counters(txn, s)[0]

    @translate
    def counters(self) -> tuple[int, int, int]:
        """(used bytes, entries, resident pinned entries), from one snapshot."""
        s = self._db()
        with s.env.begin() as txn:
            used, count = entries.counters(txn, s)
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

    @translate
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

    @translate
    def catch_up(self) -> None:
        """Make every commit visible to this process's reads. LMDB publishes a commit to readers after
        writing it, so a writer killed in between leaves its last commit unseen until the next writer takes
        the write lock (and recovers it from the dead owner); an empty write transaction is that writer."""
        s = self._db()
        with s.env.begin(write=True):
            pass

    def admit(self, key: str, entry: Entry, budget: int, touches: Mapping[str, int]) -> Admission:
        """In ONE write transaction: apply buffered touches, insert ``entry`` and evict LRU victims until
        usage <= budget. Not admitted (nothing inserted, nothing evicted) when the key is already present or
        the unpinned entries cannot free enough space. Eviction costs O(victims): every entry is evicted at
        most once per admission, so the work is amortised O(1) per put."""
        return self.admit_many([(key, entry)], budget, touches)[0]

    @translate
    def admit_many(
        self, items: Sequence[tuple[str, Entry]], budget: int, touches: Mapping[str, int]
    ) -> list[Admission]:
        """`admit` for several entries, in order, in ONE write transaction: one commit (and, syncing each
        commit, one fsync) for a whole batch instead of one per chunk. A later entry may evict an earlier one
        of the same batch when the budget is that small; its victims say so."""
        s = self._db()
        live, lost = Liveness(clock_ns()), collections.Counter[str]()
        with s.env.begin(write=True) as txn:
            self._forget_unlinked(txn, s)
            lru.touch(txn, s, touches)
            admissions = [
                entries.admit(txn, s, encode_key(key), entry, budget, live, lost) for key, entry in items
            ]
            self._log_dropped(txn, s, ChangeKind.EVICTED, [v for a in admissions for v in a.victims])
        self._add_lost(lost)
        return admissions

    @translate
    def evict(
        self, target_used: int, max_victims: int | None = None, *, keep_pending: bool = False
    ) -> Eviction:
        """In ONE write transaction: evict least recently used entries (uploaded ones first, as admissions
        do) until usage is at most ``target_used``, or ``max_victims`` went; pinned entries are never taken,
        nor, with ``keep_pending``, those still waiting for upload. The node agent calls this to keep usage
        below the budget, so admissions on the data path rarely evict."""
        s = self._db()
        live, lost = Liveness(clock_ns()), collections.Counter[str]()
        with s.env.begin(write=True) as txn:
            self._forget_unlinked(txn, s)
            eviction = entries.evict(txn, s, target_used, max_victims, live, lost, keep_pending)
            self._log_dropped(txn, s, ChangeKind.EVICTED, eviction.victims)
        self._add_lost(lost)
        return eviction

    @translate
    def apply_touches(self, touches: Mapping[str, int]) -> None:
        if not touches:
            return
        s = self._db()
        with s.env.begin(write=True) as txn:
            lru.touch(txn, s, touches)

    @translate
    def remove(self, key: str, token: bytes | None = None, reason: str = "discarded") -> Entry | None:
        """Drop ``key``'s entry (only if its file token is ``token``, when given); returns the dropped entry.
        One that waited for upload is lost for ``reason`` (see ``journal.py``).

        The token guard matters when a reader found a file missing: by the time it removes the stale entry,
        another process may have re-admitted the key under a new token, which must survive."""
        removed = self.remove_many([(key, token)], reason)
        return removed[0][1] if removed else None

    @translate
    def remove_many(
        self, items: Iterable[tuple[str, bytes | None]], reason: str = "fsck"
    ) -> list[tuple[str, Entry]]:
        """``remove`` for several keys in one write transaction; the (key, entry) dropped."""
        keys = [(key, encode_key(key), token) for key, token in items]
        s = self._db()
        live, lost = Liveness(clock_ns()), collections.Counter[str]()
        removed: list[tuple[str, Entry]] = []
        with s.env.begin(write=True) as txn:
            for key, k, token in keys:
                entry = entries.remove(txn, s, k, token, reason, live, lost)
                if entry is not None:
                    removed.append((key, entry))
            self._log_dropped(txn, s, ChangeKind.REMOVED, removed)
        self._add_lost(lost)
        return removed

    def take_lost(self) -> dict[str, int]:
        """Chunks this process's transactions settled as lost before their upload since the last call, by
        reason (the node's total is the ``uploads_lost`` counter)."""
        with self._unlinked_lock:
            lost, self._lost = dict(self._lost), collections.Counter[str]()
        return lost

    def _add_lost(self, lost: journal.Lost) -> None:
        if lost:
            with self._unlinked_lock:
                self._lost.update(lost)

    # -- files of dropped entries ------------------------------------------------------------------------

    def unlinked(self, items: Iterable[tuple[str, bytes]]) -> None:
        """(key, token) of dropped entries whose files this process deleted: forgotten by its next write."""
        records = [unlinks.record(key.encode(), token) for key, token in items]
        with self._unlinked_lock:
            self._unlinked.extend(records)
            full = len(self._unlinked) >= 4096
        if full:
            self.forget_unlinked()

    @translate
    def forget_unlinked(self) -> None:
        """Forget the deleted files ``unlinked`` reported, now (one write transaction)."""
        if self._unlinked:
            s = self._db()
            with s.env.begin(write=True) as txn:
                self._forget_unlinked(txn, s)

    @translate
    def pending_unlinks(self) -> list[tuple[str, bytes]]:
        """(key, token) of the files of dropped entries not known to be deleted: a killed process's, or in
        flight in a live one."""
        s = self._db()
        with s.env.begin() as txn:
            return unlinks.pending(txn, s)

    def _forget_unlinked(self, txn: lmdb.Transaction[bytes], s: Shared) -> None:
        with self._unlinked_lock:
            records, self._unlinked = self._unlinked, []
        unlinks.drop(txn, s, records)

    # -- node-wide counters ------------------------------------------------------------------------------

    @translate
    def add_counters(self, deltas: Mapping[str, int]) -> None:
        """Add each process's own increments to the node's counters (one write transaction)."""
        if not deltas:
            return
        s = self._db()
        with s.env.begin(write=True) as txn:
            for name, delta in deltas.items():
                k = name.encode()
                total = get_u64(txn, k, s.counters) + delta
                txn.put(k, _U64.pack(max(0, total)), db=s.counters)

    @translate
    def read_counters(self) -> dict[str, int]:
        s = self._db()
        with s.env.begin() as txn:
            return {k.decode(): _U64.unpack(v)[0] for k, v in txn.cursor(db=s.counters)}

    # -- the upload journal ------------------------------------------------------------------------------

    @translate
    def claim_uploads(
        self, limit: int, now_ns: int, lease_ns: int, holder: Holder | None = None
    ) -> list[tuple[str, Entry]]:
        """Up to `limit` queued chunks, oldest first, that no live claim holds, each now held by `holder`
        (this process) until `now_ns + lease_ns` by the boot clock (``claims.py``). One write transaction, so
        two processes never claim the same chunk while a claim holds."""
        s = self._db()
        lost = collections.Counter[str]()
        with s.env.begin(write=True) as txn:
            claimed = journal.claim(txn, s, limit, now_ns, lease_ns, holder or this_process(), lost)
        self._add_lost(lost)
        return claimed

    @translate
    def finish_uploads(
        self, done: Iterable[str], retry: Iterable[str] = (), retry_at_ns: int = 0, gone: Iterable[str] = ()
    ) -> list[str]:
        """Record an uploader's outcomes in one write transaction: `done` is in the object store now, `retry`
        failed and is claimable again from `retry_at_ns` (boot clock), `gone` will never be uploaded (its
        file went or is damaged). Returns the keys that left the cache meanwhile and are counted lost now."""
        s = self._db()
        lost = collections.Counter[str]()
        with s.env.begin(write=True) as txn:
            uploaded, lost_keys = journal.finish(txn, s, done, retry, gone, retry_at_ns, lost)
            self._log(txn, s, ChangeKind.UPLOADED, [(k, True) for k in uploaded])
        self._add_lost(lost)
        return lost_keys

    # -- the change log -----------------------------------------------------------------------------------

    @translate
    def change_seq(self) -> int:
        """The sequence number the next change will get (a new reader starts here: no history replayed)."""
        s = self._db()
        with s.env.begin() as txn:
            return changelog.next_seq(txn, s)

    @translate
    def changes_since(self, seq: int, limit: int = 4096) -> list[Change]:
        """Up to ``limit`` changes numbered ``seq`` or later, oldest first (a reader that fell behind the
        log's trimming finds a gap: those changes are gone)."""
        s = self._db()
        with s.env.begin() as txn:
            return changelog.since(txn, s, seq, limit)

    @translate
    def trim_changes(self, keep: int, max_rows: int = changelog.TRIM_SLICE) -> int:
        """Drop the oldest changes but the newest ``keep``, at most ``max_rows`` in this one transaction;
        how many went (``max_rows``: call again)."""
        s = self._db()
        with s.env.begin(write=True) as txn:
            return changelog.trim(txn, s, keep, max_rows)

    def _log(
        self, txn: lmdb.Transaction[bytes], s: Shared, kind: ChangeKind, items: Sequence[tuple[bytes, bool]]
    ) -> None:
        changelog.append(txn, s, kind, items, self._change_log_max)

    def _log_dropped(
        self, txn: lmdb.Transaction[bytes], s: Shared, kind: ChangeKind, dropped: Sequence[tuple[str, Entry]]
    ) -> None:
        """Log entries that left, each with whether the bucket had it (if not, this was its last copy)."""
        self._log(txn, s, kind, [(key.encode(), not entry.pending_upload) for key, entry in dropped])

    @translate
    def oldest_access_ns(self) -> int | None:
        """When the entry eviction would take first was last used (None: nothing is evictable)."""
        s = self._db()
        with s.env.begin() as txn:
            return lru.oldest_access_ns(txn, s)

    @translate
    def backlog(self) -> Backlog:
        """What waits for upload: counters, and the age of the oldest record."""
        s = self._db()
        with s.env.begin() as txn:
            return journal.backlog(txn, s)

    @translate
    def change_pins(self, keys: Iterable[str], delta: int) -> None:
        """Add ``delta`` (+1 or -1) to each key's pin count (see ``lru.change_pins``)."""
        encoded = [encode_key(k) for k in keys]
        s = self._db()
        with s.env.begin(write=True) as txn:
            lru.change_pins(txn, s, encoded, delta)

    # -- fsck's audit and repair -------------------------------------------------------------------------

    @translate
    def rebuild(self) -> tuple[int, int, int, int]:
        """Recompute counters, the LRU order and the upload journal from ``entries`` (fsck's repair of index
        drift). Returns (recorded used bytes, actual used bytes, recorded entries, actual entries)."""
        s = self._db()
        with s.env.begin(write=True) as txn:
            rec_used, rec_count = entries.counters(txn, s)
            used, count = entries.actual(txn, s)
            entries.set_counters(txn, s, used, count)
            lru.rebuild(txn, s)
            journal.rebuild(txn, s)
        return rec_used, used, rec_count, count

    @translate
    def audit(self) -> tuple[int, int, int, int, int]:
        """Read-only counterpart of ``rebuild``: (recorded used, actual used, recorded entries, actual
        entries, LRU and upload records that do not match exactly one entry, plus upload counter drift)."""
        s = self._db()
        with s.env.begin() as txn:
            rec_used, rec_count = entries.counters(txn, s)
            used, count = entries.actual(txn, s)
            return rec_used, used, rec_count, count, lru.drift(txn, s) + journal.drift(txn, s)
