"""Chunk format 2 (version 2): chunks bound to their keys, in 4 KiB blocks; the upload journal in the index.

Index: version-1 entries (41 bytes) describe version-1 chunk files, which readers of this release do not serve
(they are not bound to their keys). The NVMe cache is a cache: this step drops those entries, their LRU
records and their files, keeps the pins, adds the empty upload journal and stamps version 2, in one write
transaction (files are removed after it commits; fsck removes any a crash leaves behind). Chunks come back
from the bucket, or from the next prefill.

Bucket: every version-1 chunk object is verified against its own checksum and rewritten as version 2 under
its own name (the bucket is the fleet's shared copy, so nothing is dropped there); objects of other versions,
and ones that fail their check, are left as they are and counted. Resumable: version-2 objects are skipped.
`_meta/layout.json` then says version 2.
"""

from __future__ import annotations

import json
import logging
import struct

from kvstore.cache.files import ChunkFiles
from kvstore.chunk import decode_legacy, encode
from kvstore.errors import ChunkError
from kvstore.layout import LAYOUT_KEY, is_chunk_key
from kvstore.migrations.runner import MigrationContext

log = logging.getLogger(__name__)

VERSION = 2
describe = "chunk format 2: drop version-1 NVMe entries; rewrite version-1 bucket chunks as version 2"

_U64 = struct.Struct("<Q")
_V1_ENTRY = struct.Struct("<Q16sQ8sB")  # size, checksum, atime, token, state


def apply(ctx: MigrationContext) -> None:
    if ctx.env is not None:
        _migrate_index(ctx)
    if ctx.store is not None:
        _migrate_bucket(ctx)


def _migrate_index(ctx: MigrationContext) -> None:
    env = ctx.env
    assert env is not None
    entries, lru, meta = (env.open_db(n) for n in (b"entries", b"lru", b"meta"))
    env.open_db(b"uploads")  # created empty
    dropped: list[tuple[str, bytes]] = []
    with env.begin(write=True) as txn:
        raw = txn.get(b"schema_version", db=meta)
        if raw is not None and _U64.unpack(raw)[0] >= VERSION:
            return  # another process migrated it first
        for raw_key, value in txn.cursor(db=entries):
            if len(value) == _V1_ENTRY.size:
                dropped.append((raw_key.decode(), _V1_ENTRY.unpack(value)[3]))
        txn.drop(entries, delete=False)
        txn.drop(lru, delete=False)
        for name in (b"used_bytes", b"entries", b"upload_bytes", b"upload_entries"):
            txn.put(name, _U64.pack(0), db=meta)
        txn.put(b"schema_version", _U64.pack(VERSION), db=meta)
    if ctx.cache_dir is not None and dropped:
        files = ChunkFiles(ctx.cache_dir, direct_io=False)
        for key, token in dropped:
            files.unlink(key, token)
        log.info("dropped %d version-1 chunks from the NVMe cache %s", len(dropped), ctx.cache_dir)


def _migrate_bucket(ctx: MigrationContext) -> None:
    store = ctx.store
    assert store is not None
    rewritten = skipped = bad = 0
    for info in store.list():
        if not is_chunk_key(info.key):
            continue
        head = store.get_range(info.key, 0, 5)
        if head is None or len(head) < 5 or head[:4] != b"KVCH" or head[4] != 1:
            skipped += 1
            continue
        blob = store.get(info.key)
        if blob is None:
            continue  # deleted meanwhile (GC)
        try:
            raw, codec, width = decode_legacy(blob)
        except ChunkError as exc:
            log.warning("leaving %s as it is: %s", info.key, exc)
            bad += 1
            continue
        store.put(info.key, encode(info.key, raw, codec, element_width=width).to_bytes())
        rewritten += 1
    log.info(
        "bucket %s: %d chunks rewritten as version 2, %d already current or not ours, %d failed their check",
        store.url,
        rewritten,
        skipped,
        bad,
    )
    store.put(LAYOUT_KEY, json.dumps({"version": VERSION}).encode())
