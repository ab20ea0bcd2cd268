"""Driving an NVMe cache in tests through the product's own entry points (`write_file` + `commit`, the data
path's `read_into`, the change log), where the tests used to have shortcuts of their own in the cache."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.cache import CachedChunk, NVMeCache, ReadStatus
from kvstore.cache.index import CacheIndex
from kvstore.chunk import Buffer, Codec, encode
from kvstore.errors import CacheError

__all__ = ["admit", "admit_many", "cached_keys", "evicted_since", "locate", "read_chunk", "read_status"]


def admit_many(
    cache: NVMeCache,
    items: Sequence[tuple[str, Buffer]],
    *,
    pending_upload: bool = False,
    codec: Codec = Codec.NONE,
) -> list[bool]:
    """Encode, write and commit chunks in one transaction, as the store path does; per item, admitted.
    A chunk larger than the whole budget is not admitted (and never written)."""
    staged = []
    fits = []
    for key, raw in items:
        chunk = encode(key, raw, codec)
        try:
            staged.append(cache.write_file(chunk.header, chunk.parts()))
            fits.append(True)
        except CacheError:
            if chunk.header.total_length <= cache.budget_bytes:
                cache.abandon(staged)
                raise
            fits.append(False)
    admitted = iter(cache.commit(staged, pending_upload=pending_upload))
    return [next(admitted) if fit else False for fit in fits]


def admit(cache: NVMeCache, key: str, raw: Buffer, *, pending_upload: bool = False) -> bool:
    return admit_many(cache, [(key, raw)], pending_upload=pending_upload)[0]


def locate(cache: NVMeCache, key: str) -> CachedChunk | None:
    return cache.locate_many([key])[0]


def read_status(cache: NVMeCache, key: str) -> tuple[ReadStatus | None, bytes | None]:
    """(status, bytes) of the data path's read of `key` (None, None on a miss); changes nothing."""
    located = locate(cache, key)
    if located is None:
        return None, None
    out = bytearray(located.raw_length)
    result = cache.read_into(located, memoryview(out))
    return result.status, bytes(out) if result.ok else None


def read_chunk(cache: NVMeCache, key: str) -> bytes | None:
    """`key`'s raw bytes, verified by the data path's read, or None (a miss, or a copy that fails)."""
    return read_status(cache, key)[1]


def cached_keys(cache: NVMeCache) -> list[str]:
    """Every key the index holds, in key order."""
    index = CacheIndex(cache.directory)
    try:
        return [key for key, _ in index.iter_entries()]
    finally:
        index.close()


def evicted_since(cache: NVMeCache, seq: int) -> list[str]:
    """Keys the node's change log says left the cache (evicted or removed) from `seq` on."""
    return [c.key for c in cache.changes_since(seq, limit=1 << 30) if c.kind.name in ("EVICTED", "REMOVED")]
