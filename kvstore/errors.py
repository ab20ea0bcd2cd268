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
    """Bytes that claim to be a chunk cannot be trusted; they are never returned to a caller."""


class ChunkFormatError(ChunkError):
    """Malformed or truncated chunk: bad magic, unknown version or codec, wrong lengths."""


class ChecksumMismatch(ChunkError):
    """The payload decodes, but its checksum differs from the one in the header."""


class CacheError(KVStoreError):
    """The local NVMe cache cannot be used (unwritable directory, incompatible index, ...)."""
