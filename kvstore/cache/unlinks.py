"""Files to delete: the chunk files whose index entries a committed transaction dropped.

``unlinks``  8-byte file token + key -> b"": written by the transaction that drops an entry (an eviction, a
             removal), deleted again once its file is gone.

A chunk file is deleted only after the transaction that drops its entry commits (no entry may name a file
that is gone or going), so a process killed between the two leaves files that no entry names, thousands when
it was evicting. Those are named here: whoever opens the cache next deletes them (``NVMeCache``), reading a
table that holds only what is in flight, never scanning the cache. A process records the files it deleted
in its next write transaction (``CacheIndex.unlinked``), so the records cost no commit of their own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeAlias

import lmdb

from kvstore.cache.lmdb_env import Shared

Txn: TypeAlias = "lmdb.Transaction[bytes]"  # generic for type checkers only

_TOKEN = 8


def record(k: bytes, token: bytes) -> bytes:
    return token + k


def add(txn: Txn, s: Shared, k: bytes, token: bytes) -> None:
    """A file to delete once this transaction commits."""
    txn.put(record(k, token), b"", db=s.unlinks)


def drop(txn: Txn, s: Shared, records: Iterable[bytes]) -> None:
    """Forget files that are gone."""
    for rec in records:
        txn.delete(rec, db=s.unlinks)


def pending(txn: Txn, s: Shared) -> list[tuple[str, bytes]]:
    """(key, token) of every file recorded and not yet known to be gone."""
    return [(rec[_TOKEN:].decode(), rec[:_TOKEN]) for rec in txn.cursor(db=s.unlinks).iternext(values=False)]
