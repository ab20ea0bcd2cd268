"""The library's exception tree: one root, a few precise leaves.

Backends translate their own exceptions at their edge; callers above the library (the vLLM tier, the admin
API) catch `KVStoreError` and turn it into a miss, a metric or an HTTP error.
"""


class KVStoreError(Exception):
    """Root of every error this library raises on purpose."""


class ConfigError(KVStoreError, ValueError):
    """A setting is missing, malformed or out of range. The message names the setting."""


class StoreError(KVStoreError):
    """An object store operation failed."""


class StoreUnavailable(StoreError):
    """The object store could not be reached in time (connection refused, timeout, 5xx after retries)."""


class StoreAuthError(StoreError):
    """The object store rejected the credentials or denied access."""


class BucketNotFound(StoreError):
    """The configured bucket does not exist."""


class ChunkError(KVStoreError):
    """Bytes that claim to be a chunk cannot be served; they are never returned to a caller."""


class ChunkCorrupt(ChunkError):
    """Proven damage to a chunk in a format this reader knows: the only kind a reader may delete."""


class ChunkFormatError(ChunkCorrupt):
    """A chunk of a known version whose header or lengths are inconsistent, or whose bytes are truncated."""


class ChecksumMismatch(ChunkCorrupt):
    """The payload decodes, but its bytes (or its key) do not match the checksum in the header."""


class KeyMismatch(ChunkCorrupt):
    """A valid chunk stored under another key's name: never served as that key's KV."""


class ChunkUnreadable(ChunkError):
    """This reader cannot interpret the chunk (a newer version, an unknown codec, another buffer size, not a
    kvstore chunk at all): a miss, and the chunk is left alone for the readers that can."""


class LegacyChunk(ChunkUnreadable):
    """A version-1 chunk: valid, but not bound to its key, so it is not served; `kvstore migrate` upgrades
    it."""


class CacheError(KVStoreError):
    """The local NVMe cache cannot be used (unwritable directory, incompatible index, ...)."""


class IndexSuspect(CacheError):
    """The cache index may be damaged: the machine stopped while a process had commits of it unflushed
    (`kvstore.cache.index_flush`). Rebuild it from the chunk files before use."""


class CacheFull(CacheError):
    """The cache's filesystem has no room for a chunk file (ENOSPC, a quota): make room, then try again."""


class CacheClosed(CacheError):
    """The cache was closed: whoever still holds it (a background loop after shutdown) should stop."""
