"""The upload journal: which chunks on this node still wait for their upload, who holds each, and what became
of those that left the cache first.

``uploads``  8-byte big-endian queued ns + key -> ``<Q`` not-before ns by the wall clock: the journal, oldest
             first. The NVMe copy is the only copy of such a chunk until an uploader PUTs it. The value is
             kept for earlier releases on the node; this one judges claims by ``claims`` (``claims.py``).
``claims``   the same record key -> who holds it until when (an uploader's lease, or a retry time).
``adrift``   key -> a reason byte + the claim: a chunk that left the cache (evicted, discarded, lost) while an
             uploader held it. Its upload may still finish; the uploader's outcome decides, or, once the claim
             no longer holds (the uploader died), the next claimer counts it lost.
``counters`` ``uploads_lost`` (``<Q``): every chunk that left the cache before its upload, counted once for
             the whole node by the transaction that settles it, so nothing is counted twice or never, whatever
             process dies when (each process also learns its own share: ``lost`` of the calls).
``meta``     ``upload_bytes`` and ``upload_entries`` (``<Q``), kept in step with ``uploads``.

These functions work inside the index's transactions (``index.py`` opens them): a chunk joins the journal in
the transaction that admits it and leaves it in the one that evicts, removes or marks it uploaded.
"""

from __future__ import annotations

import collections
import struct
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import TypeAlias

import lmdb

from kvstore.cache.claims import Claim, Holder, Liveness, clock_ns
from kvstore.cache.lmdb_env import Shared, get_u64
from kvstore.cache.records import Backlog, Entry

Txn: TypeAlias = "lmdb.Transaction[bytes]"  # generic for type checkers only
Lost: TypeAlias = "collections.Counter[str]"  # chunks that left before their upload, by reason

REASONS = ("evicted", "discarded", "fsck", "lost")  # why a chunk left the cache
LOST_COUNTER = b"uploads_lost"
_U64 = struct.Struct("<Q")
_TS = struct.Struct(">Q")  # big-endian so LMDB's byte order is time order
_UPLOAD_BYTES_KEY = b"upload_bytes"
_UPLOAD_COUNT_KEY = b"upload_entries"


def record_key(k: bytes, entry: Entry) -> bytes:
    """The journal record of a queued entry: queued time first, so the journal reads oldest first."""
    return _TS.pack(entry.queued_ns) + k


def queue(txn: Txn, s: Shared, k: bytes, entry: Entry) -> None:
    """Put a pending entry in the journal (claimable at once)."""
    txn.put(record_key(k, entry), _U64.pack(0), db=s.uploads)
    add_counters(txn, s, entry.size, 1)


def leave(txn: Txn, s: Shared, k: bytes, entry: Entry, reason: str, lost: Lost, live: Liveness) -> bool:
    """`entry` leaves the cache: out of the journal. One still waiting for upload is lost (counted), or,
    while an uploader holds it, adrift until the uploader says. Whether it went adrift."""
    if not entry.pending_upload:
        return False
    record = record_key(k, entry)
    raw = txn.get(record, db=s.claims)
    _unqueue(txn, s, record, entry)
    if raw is not None and live.holds(claim := Claim.unpack(raw)):
        txn.put(k, bytes((REASONS.index(reason),)) + claim.pack(), db=s.adrift)
        return True
    _count_lost(txn, s, lost, reason)
    return False


def _unqueue(txn: Txn, s: Shared, record: bytes, entry: Entry) -> None:
    if txn.delete(record, db=s.uploads):
        add_counters(txn, s, -entry.size, -1)
    txn.delete(record, db=s.claims)


def claim(
    txn: Txn, s: Shared, limit: int, now_ns: int, lease_ns: int, holder: Holder, lost: Lost
) -> list[tuple[str, Entry]]:
    """Up to `limit` queued chunks, oldest first, that no live claim holds, each now held by `holder` until
    `now_ns + lease_ns` (boot clock). Chunks adrift whose claim no longer holds are counted lost."""
    live = Liveness(now_ns)
    _settle_adrift(txn, s, live, lost)
    claimed: list[tuple[str, Entry]] = []
    mine = Claim.of(now_ns + lease_ns, holder).pack()
    legacy = _U64.pack(time.time_ns() + lease_ns)
    stale: list[bytes] = []
    for record in txn.cursor(db=s.uploads).iternext(values=False):
        if len(claimed) >= limit:
            break
        held = txn.get(record, db=s.claims)
        if held is not None and live.holds(Claim.unpack(held)):
            continue  # no claim: free (or an earlier release's claim: uploading twice is harmless)
        k = record[8:]
        raw = txn.get(k, db=s.entries)
        entry = None if raw is None else Entry.unpack(raw)
        if entry is None or _TS.pack(entry.queued_ns) != record[:8]:
            stale.append(record)  # self-healing: a record whose entry left or changed
            continue
        txn.put(record, mine, db=s.claims)
        txn.put(record, legacy, db=s.uploads)
        claimed.append((k.decode(), entry))
    for record in stale:
        txn.delete(record, db=s.uploads)
        txn.delete(record, db=s.claims)
    return claimed


def _settle_adrift(txn: Txn, s: Shared, live: Liveness, lost: Lost) -> None:
    """Chunks adrift whose uploader is gone (its claim expired or its process died) never made it: lost."""
    settled = []
    for k, value in txn.cursor(db=s.adrift):
        if not live.holds(Claim.unpack(value[1:])):
            settled.append((k, REASONS[value[0]]))
    for k, reason in settled:
        txn.delete(k, db=s.adrift)
        _count_lost(txn, s, lost, reason)


def finish(
    txn: Txn,
    s: Shared,
    done: Iterable[str],
    retry: Iterable[str],
    gone: Iterable[str],
    retry_at_ns: int,
    lost: Lost,
) -> tuple[list[bytes], list[str]]:
    """The uploader's outcomes: `done` reached the object store, `retry` failed and may be claimed again
    from `retry_at_ns` (boot clock), `gone` never will be (its file went, or was damaged). Returns the keys
    that reached the store and the keys counted lost now."""
    uploaded: list[bytes] = []
    for key in done:
        k = key.encode()
        reached = txn.delete(k, db=s.adrift)  # it left the cache, but its upload made it
        raw = txn.get(k, db=s.entries)
        if raw is not None and (entry := Entry.unpack(raw)).pending_upload:
            _unqueue(txn, s, record_key(k, entry), entry)
            txn.put(k, replace(entry, queued_ns=0).pack(), db=s.entries)
            reached = True
        if reached:
            uploaded.append(k)
    settled: list[str] = []
    later = Claim.of(retry_at_ns, None).pack()
    legacy = _U64.pack(time.time_ns() + max(0, retry_at_ns - clock_ns()))
    for key in retry:
        k = key.encode()
        if _settle(txn, s, k, lost):
            settled.append(key)
            continue
        raw = txn.get(k, db=s.entries)
        if raw is not None and (entry := Entry.unpack(raw)).pending_upload:
            record = record_key(k, entry)
            if txn.get(record, db=s.uploads) is not None:
                txn.put(record, later, db=s.claims)
                txn.put(record, legacy, db=s.uploads)
    settled += [key for key in gone if _settle(txn, s, key.encode(), lost)]
    return uploaded, settled


def _settle(txn: Txn, s: Shared, k: bytes, lost: Lost) -> bool:
    """A chunk adrift whose upload will not happen: lost. Whether it was adrift."""
    value = txn.get(k, db=s.adrift)
    if value is None:
        return False
    txn.delete(k, db=s.adrift)
    _count_lost(txn, s, lost, REASONS[value[0]])
    return True


def _count_lost(txn: Txn, s: Shared, lost: Lost, reason: str) -> None:
    txn.put(LOST_COUNTER, _U64.pack(get_u64(txn, LOST_COUNTER, s.counters) + 1), db=s.counters)
    lost[reason] += 1


def backlog(txn: Txn, s: Shared) -> Backlog:
    """What waits for upload: counters, and the age of the oldest record (the first in key order)."""
    nbytes, count = counters(txn, s)
    cursor = txn.cursor(db=s.uploads)
    oldest = _TS.unpack(cursor.key()[:8])[0] if cursor.first() else 0
    return Backlog(chunks=count, bytes=nbytes, oldest_queued_ns=oldest)


def rebuild(txn: Txn, s: Shared) -> None:
    """Recompute the journal from ``entries``, keeping the claims of records that match."""
    kept = {r: v for r, v in txn.cursor(db=s.claims)}
    txn.drop(s.uploads, delete=False)
    txn.drop(s.claims, delete=False)
    nbytes = count = 0
    for k, raw in txn.cursor(db=s.entries):
        entry = Entry.unpack(raw)
        if entry.pending_upload:
            record = record_key(k, entry)
            txn.put(record, _U64.pack(0), db=s.uploads)
            if record in kept:
                txn.put(record, kept[record], db=s.claims)
            nbytes += entry.size
            count += 1
    txn.put(_UPLOAD_BYTES_KEY, _U64.pack(nbytes), db=s.meta)
    txn.put(_UPLOAD_COUNT_KEY, _U64.pack(count), db=s.meta)


def drift(txn: Txn, s: Shared) -> int:
    """Records that do not match exactly one pending entry, plus counters that disagree with the entries."""
    queued: set[bytes] = set()
    nbytes = 0
    for k, raw in txn.cursor(db=s.entries):
        entry = Entry.unpack(raw)
        if entry.pending_upload:
            queued.add(record_key(k, entry))
            nbytes += entry.size
    recorded = set(txn.cursor(db=s.uploads).iternext(values=False))
    rec_bytes, rec_count = counters(txn, s)
    return len(queued ^ recorded) + (rec_bytes != nbytes) + (rec_count != len(queued))


def counters(txn: Txn, s: Shared) -> tuple[int, int]:
    """(bytes, chunks) waiting for upload."""
    return get_u64(txn, _UPLOAD_BYTES_KEY, s.meta), get_u64(txn, _UPLOAD_COUNT_KEY, s.meta)


def add_counters(txn: Txn, s: Shared, nbytes: int, count: int) -> None:
    have_bytes, have_count = counters(txn, s)
    txn.put(_UPLOAD_BYTES_KEY, _U64.pack(max(0, have_bytes + nbytes)), db=s.meta)
    txn.put(_UPLOAD_COUNT_KEY, _U64.pack(max(0, have_count + count)), db=s.meta)
