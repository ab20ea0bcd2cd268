"""Baseline (version 1): stamp schema version 1 on a pre-versioned cache index and write `_meta/layout.json`.

A version-0 index (from before the schema was versioned) has entries but no `schema_version` and no
`used_bytes`/`entries` counters, and may have an LRU database out of step with its entries. This step
recomputes both from `entries` (pinned keys get no LRU record) and stamps version 1, in one LMDB write
transaction, so a crash leaves either the old index or the migrated one. The bucket gets its layout marker.
"""

from __future__ import annotations

import json
import struct

from kvstore.layout import LAYOUT_KEY
from kvstore.migrations.runner import MigrationContext

VERSION = 1
describe = "baseline: stamp index schema 1 (recompute counters and LRU); write _meta/layout.json"

_U64 = struct.Struct("<Q")
_TS = struct.Struct(">Q")
_ENTRY = struct.Struct(
    "<Q16sQ8sB"
)  # the v1 entry layout, unchanged from v0: size, checksum, atime, token, state


def apply(ctx: MigrationContext) -> None:
    if ctx.env is not None:
        _migrate_index(ctx)
    if ctx.store is not None:
        # Create-only: a concurrent runner or a newer writer wins, and the runner re-reads the version.
        ctx.store.put_if_absent(LAYOUT_KEY, json.dumps({"version": VERSION}).encode())


def _migrate_index(ctx: MigrationContext) -> None:
    env = ctx.env
    assert env is not None
    entries, lru, pins, meta = (env.open_db(n) for n in (b"entries", b"lru", b"pins", b"meta"))
    with env.begin(write=True) as txn:
        raw = txn.get(b"schema_version", db=meta)
        if raw is not None and _U64.unpack(raw)[0] >= VERSION:
            return  # another process migrated it first
        used = count = 0
        txn.drop(lru, delete=False)
        for key, value in txn.cursor(db=entries):
            size, _checksum, atime, _token, _state = _ENTRY.unpack(value)
            used += size
            count += 1
            if txn.get(key, db=pins) is None:
                txn.put(_TS.pack(atime) + key, b"", db=lru)
        txn.put(b"used_bytes", _U64.pack(used), db=meta)
        txn.put(b"entries", _U64.pack(count), db=meta)
        txn.put(b"schema_version", _U64.pack(VERSION), db=meta)
