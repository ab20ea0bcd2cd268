"""Entries in and out, inside the index's transactions: admitting one (evicting what the budget requires)
and dropping one, with everything that must change with it in the same transaction: the usage counters, the
LRU order, the upload journal (a chunk still waiting for upload is lost, or adrift while an uploader holds
it), and the name of its file, deleted after the commit (``unlinks.py``). Logging the change is the
caller's: one append per transaction (``changelog.py``).

``meta``  ``used_bytes`` and ``entries`` (``<Q``), kept in step with ``entries``.
"""

from __future__ import annotations

import struct
from typing import TypeAlias

import lmdb

from kvstore.cache import journal, lru, unlinks
from kvstore.cache.claims import Liveness
from kvstore.cache.lmdb_env import Shared, get_u64
from kvstore.cache.records import Admission, Entry, Eviction

Txn: TypeAlias = "lmdb.Transaction[bytes]"  # generic for type checkers only

_U64 = struct.Struct("<Q")
_USED_KEY = b"used_bytes"
_COUNT_KEY = b"entries"


def admit(
    txn: Txn, s: Shared, k: bytes, entry: Entry, budget: int, live: Liveness, lost: journal.Lost
) -> Admission:
    """Insert ``entry`` and evict LRU victims until usage <= budget. Not admitted (nothing inserted, nothing
    evicted) when the key is already present or the unpinned entries cannot free enough space."""
    if txn.get(k, db=s.entries) is not None:
        return Admission(False)
    used, count = counters(txn, s)
    need = used + entry.size - budget
    victims: list[tuple[bytes, Entry]] = []
    if need > 0:
        victims = lru.pick_victims(txn, s, need)
        if sum(v.size for _, v in victims) < need:
            return Admission(False)
    uploading = _drop_all(txn, s, victims, live, lost)
    txn.put(k, entry.pack(), db=s.entries)
    lru.add(txn, s, k, entry)
    if entry.pending_upload:
        journal.queue(txn, s, k, entry)
    freed = sum(ve.size for _, ve in victims)
    set_counters(txn, s, used - freed + entry.size, count - len(victims) + 1)
    return Admission(True, tuple((vk.decode(), ve) for vk, ve in victims), frozenset(uploading))


def evict(
    txn: Txn,
    s: Shared,
    target_used: int,
    max_victims: int | None,
    live: Liveness,
    lost: journal.Lost,
    keep_pending: bool = False,
) -> Eviction:
    """Evict least recently used entries until usage is at most ``target_used`` or ``max_victims`` went
    (with ``keep_pending``, none that still waits for upload: usage may stay above the target)."""
    used, count = counters(txn, s)
    if used <= target_used:
        return Eviction()
    victims = lru.pick_victims(txn, s, used - target_used, max_victims, keep_pending=keep_pending)
    uploading = _drop_all(txn, s, victims, live, lost)
    freed = sum(ve.size for _, ve in victims)
    set_counters(txn, s, max(0, used - freed), max(0, count - len(victims)))
    return Eviction(tuple((vk.decode(), ve) for vk, ve in victims), frozenset(uploading))


def remove(
    txn: Txn, s: Shared, k: bytes, token: bytes | None, reason: str, live: Liveness, lost: journal.Lost
) -> Entry | None:
    """Drop ``k``'s entry (only if its file token is ``token``, when given); the entry dropped."""
    raw = txn.get(k, db=s.entries)
    if raw is None:
        return None
    entry = Entry.unpack(raw)
    if token is not None and entry.token != token:
        return None
    _drop(txn, s, k, entry, reason, live, lost)
    used, count = counters(txn, s)
    set_counters(txn, s, max(0, used - entry.size), max(0, count - 1))
    return entry


def _drop_all(
    txn: Txn, s: Shared, victims: list[tuple[bytes, Entry]], live: Liveness, lost: journal.Lost
) -> set[str]:
    """Drop evicted entries (not the counters); those an uploader holds (adrift: its upload may finish)."""
    return {vk.decode() for vk, ve in victims if _drop(txn, s, vk, ve, "evicted", live, lost)}


def _drop(
    txn: Txn, s: Shared, k: bytes, entry: Entry, reason: str, live: Liveness, lost: journal.Lost
) -> bool:
    txn.delete(k, db=s.entries)
    lru.drop(txn, s, k, entry)
    unlinks.add(txn, s, k, entry.token)
    return journal.leave(txn, s, k, entry, reason, lost, live)


def counters(txn: Txn, s: Shared) -> tuple[int, int]:
    """(used bytes, entries) as recorded."""
    return get_u64(txn, _USED_KEY, s.meta), get_u64(txn, _COUNT_KEY, s.meta)


def set_counters(txn: Txn, s: Shared, used: int, count: int) -> None:
    txn.put(_USED_KEY, _U64.pack(used), db=s.meta)
    txn.put(_COUNT_KEY, _U64.pack(count), db=s.meta)


def actual(txn: Txn, s: Shared) -> tuple[int, int]:
    """(used bytes, entries) as the entries add up."""
    sizes = [Entry.unpack(raw).size for raw in txn.cursor(db=s.entries).iternext(keys=False)]
    return sum(sizes), len(sizes)
