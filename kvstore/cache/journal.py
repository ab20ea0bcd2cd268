"""The upload journal: which chunks on this node still wait for their upload, and who holds each.

``uploads``  8-byte big-endian queued ns + key -> ``<Q`` not-before ns: the journal, oldest first. The NVMe
             copy is the only copy of such a chunk until an uploader PUTs it; an uploader claims a batch by
             moving its not-before time past a lease, so the node's processes share the work and a crashed
             uploader's claims expire. A failed PUT moves it to the retry time.
``meta``     ``upload_bytes`` and ``upload_entries`` (``<Q``), kept in step with ``uploads``.

These functions work inside the index's transactions (``index.py`` opens them): a chunk joins the journal in
the transaction that admits it and leaves it in the one that evicts, removes or marks it uploaded.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import replace
from typing import TypeAlias

import lmdb

from kvstore.cache.lmdb_env import Shared
from kvstore.cache.records import Backlog, Entry

_U64 = struct.Struct("<Q")
_TS = struct.Struct(">Q")  # big-endian so LMDB's byte order is time order
_UPLOAD_BYTES_KEY = b"upload_bytes"
_UPLOAD_COUNT_KEY = b"upload_entries"

Txn: TypeAlias = "lmdb.Transaction[bytes]"  # generic for type checkers only


def record_key(k: bytes, entry: Entry) -> bytes:
    """The journal record of a queued entry: queued time first, so the journal reads oldest first."""
    return _TS.pack(entry.queued_ns) + k


def queue(txn: Txn, s: Shared, k: bytes, entry: Entry) -> None:
    """Put a pending entry in the journal (claimable at once)."""
    txn.put(record_key(k, entry), _U64.pack(0), db=s.uploads)
    add_counters(txn, s, entry.size, 1)


def unqueue(txn: Txn, s: Shared, k: bytes, entry: Entry) -> int:
    """Drop `entry`'s record, if it has one (it is leaving, or has been uploaded); the record's not-before
    time (in the future while an uploader holds it), 0 if there was none."""
    if not entry.pending_upload:
        return 0
    record = record_key(k, entry)
    value = txn.get(record, db=s.uploads)
    if value is None:
        return 0
    txn.delete(record, db=s.uploads)
    add_counters(txn, s, -entry.size, -1)
    return int(_U64.unpack(value)[0])


def claim(txn: Txn, s: Shared, limit: int, now_ns: int, lease_ns: int) -> list[tuple[str, Entry]]:
    """Up to `limit` queued chunks, oldest first, that nobody holds, each now held until `now_ns +
    lease_ns`."""
    claimed: list[tuple[str, Entry]] = []
    until = _U64.pack(now_ns + lease_ns)
    stale: list[bytes] = []
    for record, value in txn.cursor(db=s.uploads):
        if len(claimed) >= limit:
            break
        if _U64.unpack(value)[0] > now_ns:
            continue
        k = record[8:]
        raw = txn.get(k, db=s.entries)
        entry = None if raw is None else Entry.unpack(raw)
        if entry is None or _TS.pack(entry.queued_ns) != record[:8]:
            stale.append(record)  # self-healing: a record whose entry left or changed
            continue
        txn.put(record, until, db=s.uploads)
        claimed.append((k.decode(), entry))
    for record in stale:
        txn.delete(record, db=s.uploads)
    return claimed


def finish(
    txn: Txn, s: Shared, done: Iterable[str], retry: Iterable[str], retry_at_ns: int
) -> tuple[list[bytes], list[str]]:
    """Mark `done` uploaded and make `retry` claimable from `retry_at_ns` on; returns the keys marked
    uploaded and the failed ones that left the cache meanwhile (never to be uploaded)."""
    uploaded: list[bytes] = []
    for key in done:
        k = key.encode()
        raw = txn.get(k, db=s.entries)
        if raw is None:
            continue
        entry = Entry.unpack(raw)
        if entry.pending_upload:
            unqueue(txn, s, k, entry)
            txn.put(k, replace(entry, queued_ns=0).pack(), db=s.entries)
            uploaded.append(k)
    gone: list[str] = []
    again = _U64.pack(retry_at_ns)
    for key in retry:
        k = key.encode()
        raw = txn.get(k, db=s.entries)
        if raw is None:
            gone.append(key)
        elif (entry := Entry.unpack(raw)).pending_upload:
            record = record_key(k, entry)
            if txn.get(record, db=s.uploads) is not None:
                txn.put(record, again, db=s.uploads)
    return uploaded, gone


def backlog(txn: Txn, s: Shared) -> Backlog:
    """What waits for upload: counters, and the age of the oldest record (the first in key order)."""
    nbytes, count = counters(txn, s)
    cursor = txn.cursor(db=s.uploads)
    oldest = _TS.unpack(cursor.key()[:8])[0] if cursor.first() else 0
    return Backlog(chunks=count, bytes=nbytes, oldest_queued_ns=oldest)


def rebuild(txn: Txn, s: Shared) -> None:
    """Recompute the journal from ``entries``, keeping the not-before times of records that match."""
    not_before = dict(txn.cursor(db=s.uploads))
    txn.drop(s.uploads, delete=False)
    nbytes = count = 0
    for k, raw in txn.cursor(db=s.entries):
        entry = Entry.unpack(raw)
        if entry.pending_upload:
            record = record_key(k, entry)
            txn.put(record, not_before.get(record, _U64.pack(0)), db=s.uploads)
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
    nbytes = txn.get(_UPLOAD_BYTES_KEY, db=s.meta)
    count = txn.get(_UPLOAD_COUNT_KEY, db=s.meta)
    return (
        0 if nbytes is None else _U64.unpack(nbytes)[0],
        0 if count is None else _U64.unpack(count)[0],
    )


def add_counters(txn: Txn, s: Shared, nbytes: int, count: int) -> None:
    have_bytes, have_count = counters(txn, s)
    txn.put(_UPLOAD_BYTES_KEY, _U64.pack(max(0, have_bytes + nbytes)), db=s.meta)
    txn.put(_UPLOAD_COUNT_KEY, _U64.pack(max(0, have_count + count)), db=s.meta)
