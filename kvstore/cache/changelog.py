"""The node's change log: what happened to chunks on this node, in order, for every engine to read.

``changes``  8-byte big-endian sequence number -> kind byte (high bit set: the chunk had not reached the
             object store) + key. Every transaction that evicts, removes or finishes uploading a chunk
             appends to it, so each engine on the node learns what the others (and the node agent) did to
             the chunks it announced, and turns that into KV events.
``meta``     ``changes_next`` (``<Q``): the sequence number the next change gets.

These functions work inside the index's transactions (``index.py`` opens them), so a change is logged by
the very transaction that makes it: a process killed between the two cannot leave a gap.

The log is bounded whoever runs: a transaction that appends past ``MAX_CHANGES`` drops as many of the oldest
changes as it adds (a few more while the log is over its bound), so the engines' own commits keep it in
bounds while no node agent trims it, at a cost proportional to what they append. Trimming drops at most
``TRIM_SLICE`` changes per transaction: LMDB lets one writer in at a time, and an engine's store waits for the
lock behind whatever a trim does in one go (809k rows in one transaction once stalled stores for 666 ms).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TypeAlias

import lmdb

from kvstore.cache.lmdb_env import Shared
from kvstore.cache.records import Change, ChangeKind

_U64 = struct.Struct("<Q")
_SEQ = struct.Struct(">Q")  # big-endian so LMDB's byte order is sequence order
_NEXT_KEY = b"changes_next"
_NOT_UPLOADED = 0x80  # in a change's kind byte: the chunk had not reached the object store
MAX_CHANGES = 200_000  # about 30 MB of index; an engine reads the log every fraction of a second
TRIM_SLICE = 2_000  # changes one trimming transaction drops at most (a few ms)
_CATCH_UP = 64  # dropped per append beyond what it adds, while a log is over its bound

Txn: TypeAlias = "lmdb.Transaction[bytes]"  # generic for type checkers only


def append(
    txn: Txn, s: Shared, kind: ChangeKind, items: Sequence[tuple[bytes, bool]], bound: int = MAX_CHANGES
) -> None:
    """Append (key, whether the bucket had it) changes of one kind; the oldest go past ``bound``."""
    if not items:
        return
    seq = next_seq(txn, s)
    for k, uploaded in items:
        tag = bytes((kind | (0 if uploaded else _NOT_UPLOADED),))
        txn.put(_SEQ.pack(seq), tag + k, db=s.changes)
        seq += 1
    txn.put(_NEXT_KEY, _U64.pack(seq), db=s.meta)
    excess = int(txn.stat(s.changes)["entries"]) - bound
    if excess > 0:
        _drop_oldest(txn, s, seq, min(excess, len(items) + _CATCH_UP))


def next_seq(txn: Txn, s: Shared) -> int:
    """The sequence number the next change will get."""
    raw = txn.get(_NEXT_KEY, db=s.meta)
    return 1 if raw is None else int(_U64.unpack(raw)[0])


def since(txn: Txn, s: Shared, seq: int, limit: int) -> list[Change]:
    """Up to ``limit`` changes numbered ``seq`` or later, oldest first."""
    out: list[Change] = []
    cursor = txn.cursor(db=s.changes)
    if not cursor.set_range(_SEQ.pack(max(0, seq))):
        return out
    for record, value in cursor:
        kind, key = ChangeKind(value[0] & ~_NOT_UPLOADED), bytes(value[1:]).decode()
        out.append(Change(_SEQ.unpack(record)[0], kind, key, uploaded=not value[0] & _NOT_UPLOADED))
        if len(out) >= limit:
            break
    return out


def trim(txn: Txn, s: Shared, keep: int, max_rows: int = TRIM_SLICE) -> int:
    """Drop the oldest changes but the newest ``keep``, at most ``max_rows`` of them; how many went."""
    return _drop_oldest(txn, s, next_seq(txn, s) - keep, max_rows)


def _drop_oldest(txn: Txn, s: Shared, first_kept: int, max_rows: int) -> int:
    """Drop changes numbered below ``first_kept``, oldest first, at most ``max_rows``."""
    dropped = 0
    cursor = txn.cursor(db=s.changes)
    if cursor.first():
        while dropped < max_rows and cursor.key() and _SEQ.unpack(cursor.key())[0] < first_kept:
            cursor.delete()  # moves to the next record (an empty key past the last)
            dropped += 1
    return dropped
