"""LRU order and pins: which entries eviction may take, least recently used first.

``lru``   8-byte big-endian last access ns + key -> b"". Holds only *evictable* entries: a pinned entry has
          no LRU record, so eviction walks from the oldest record and never has to skip pinned ones.
``pins``  key -> ``<Q`` pin count. Counts exist for keys not (yet) cached, so a pinned prompt admitted later
          is never evicted. Pins persist: they are node-wide state, not per-process leases.

Touches move an entry's record to its new access time; a pin takes the record away, the last unpin puts it
back. These functions work inside the index's transactions (``index.py`` opens them).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TypeAlias

import lmdb

from kvstore.cache.lmdb_env import Shared, get_u64
from kvstore.cache.records import Entry

Txn: TypeAlias = "lmdb.Transaction[bytes]"  # generic for type checkers only

# Eviction passes over at most this many chunks that still wait for upload to find uploaded ones: bounded
# work per admission, and under a long outage (everything waits) plain LRU order again.
UPLOAD_LOOKAHEAD = 256
# The node agent's eviction, which keeps every chunk that waits for upload, looks past this many of them for
# uploaded ones: off the data path it can look further, yet its write transaction stays short.
KEEP_PENDING_LOOKAHEAD = 16 * UPLOAD_LOOKAHEAD

_U64 = struct.Struct("<Q")
_TS = struct.Struct(">Q")  # big-endian so LMDB's byte order is time order


def lru_key(ts: int, key: bytes) -> bytes:
    return _TS.pack(ts) + key


def oldest_access_ns(txn: Txn, s: Shared) -> int | None:
    """When the least recently used evictable entry was last used (None: no such entry)."""
    cursor = txn.cursor(db=s.lru)
    return _TS.unpack(cursor.key()[:8])[0] if cursor.first() else None


def add(txn: Txn, s: Shared, k: bytes, entry: Entry) -> None:
    """A new entry joins the LRU order, unless it is pinned."""
    if txn.get(k, db=s.pins) is None:
        txn.put(lru_key(entry.last_access_ns, k), b"", db=s.lru)


def drop(txn: Txn, s: Shared, k: bytes, entry: Entry) -> None:
    txn.delete(lru_key(entry.last_access_ns, k), db=s.lru)


def pick_victims(
    txn: Txn, s: Shared, need: int, limit: int | None = None, *, keep_pending: bool = False
) -> list[tuple[bytes, Entry]]:
    """Entries whose sizes add up to ``need`` (or ``limit`` of them), least recently used first, but an entry
    still waiting for upload (its only copy) is passed over for an uploaded one within the next
    ``UPLOAD_LOOKAHEAD`` records; past that, it goes too. With ``keep_pending`` it never goes (the victims
    may then add up to less than ``need``), and the scan ends past ``KEEP_PENDING_LOOKAHEAD`` of them."""
    victims: list[tuple[bytes, Entry]] = []
    passed_over: list[tuple[bytes, Entry]] = []
    kept = 0
    stale: list[bytes] = []
    freed = 0
    for lk in txn.cursor(db=s.lru).iternext(values=False):
        vk = lk[8:]
        raw = txn.get(vk, db=s.entries)
        entry = None if raw is None else Entry.unpack(raw)
        if entry is None or entry.last_access_ns != _TS.unpack(lk[:8])[0] or txn.get(vk, db=s.pins):
            stale.append(lk)  # self-healing: a record that no longer matches an evictable entry
            continue
        if entry.pending_upload and keep_pending:
            kept += 1
            if kept > KEEP_PENDING_LOOKAHEAD:
                break
            continue
        if entry.pending_upload and len(passed_over) < UPLOAD_LOOKAHEAD:
            passed_over.append((vk, entry))
            continue
        victims.append((vk, entry))
        freed += entry.size
        if freed >= need or len(victims) == limit:
            break
    for vk, entry in passed_over:  # not enough without them: the oldest of them go after all
        if freed >= need or len(victims) == limit:
            break
        victims.append((vk, entry))
        freed += entry.size
    for lk in stale:
        txn.delete(lk, db=s.lru)
    return victims


def touch(txn: Txn, s: Shared, touches: Mapping[str, int]) -> None:
    """Move entries to their newer access times (an older one than recorded changes nothing)."""
    for key, ts in touches.items():
        k = key.encode()
        raw = txn.get(k, db=s.entries)
        if raw is None:
            continue
        entry = Entry.unpack(raw)
        if ts <= entry.last_access_ns:
            continue  # another process saw it more recently
        if txn.get(k, db=s.pins) is None:
            txn.delete(lru_key(entry.last_access_ns, k), db=s.lru)
            txn.put(lru_key(ts, k), b"", db=s.lru)
        txn.put(k, replace(entry, last_access_ns=ts).pack(), db=s.entries)


def change_pins(txn: Txn, s: Shared, keys: Iterable[bytes], delta: int) -> None:
    """Add ``delta`` (+1 or -1) to each key's pin count; counts never go below zero. A key whose count
    leaves zero loses its LRU record (eviction cannot see it); one that returns to zero gets it back."""
    for k in keys:
        old = get_u64(txn, k, s.pins)
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
        lk = lru_key(Entry.unpack(raw_entry).last_access_ns, k)
        if new:
            txn.delete(lk, db=s.lru)
        else:
            txn.put(lk, b"", db=s.lru)


def pin_count(txn: Txn, s: Shared, k: bytes) -> int:
    return get_u64(txn, k, s.pins)


def rebuild(txn: Txn, s: Shared) -> None:
    """Recompute the LRU order from ``entries`` and ``pins``."""
    txn.drop(s.lru, delete=False)
    for k, raw in txn.cursor(db=s.entries):
        add(txn, s, k, Entry.unpack(raw))


def drift(txn: Txn, s: Shared) -> int:
    """LRU records that do not match exactly one evictable entry."""
    expected = {
        lru_key(Entry.unpack(raw).last_access_ns, k)
        for k, raw in txn.cursor(db=s.entries)
        if txn.get(k, db=s.pins) is None
    }
    return len(expected ^ set(txn.cursor(db=s.lru).iternext(values=False)))
