"""The values the NVMe cache records and hands around: an index entry (the 58-byte ``entries`` record that
``index.py`` documents), the outcome of an admission or an eviction, the upload backlog, a change of the
node's change log; a located chunk, a read's result, a file written but not yet committed, and the cache's
usage."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import Enum, IntEnum

from kvstore.errors import CacheError

STATE_READY = 1
MAX_KEY_BYTES = 500  # LMDB's key limit is 511 bytes and LRU keys carry an 8-byte prefix

_ENTRY = struct.Struct("<Q16sQ8sBBQQ")


@dataclass(frozen=True)
class Entry:
    """One cached chunk as the index records it."""

    size: int
    checksum: bytes
    last_access_ns: int
    token: bytes
    state: int = STATE_READY
    codec: int = 0
    raw_length: int = 0
    queued_ns: int = 0  # when it was queued for upload; 0 when nothing is left to upload

    @property
    def pending_upload(self) -> bool:
        return self.queued_ns != 0

    def pack(self) -> bytes:
        return _ENTRY.pack(
            self.size,
            self.checksum,
            self.last_access_ns,
            self.token,
            self.state,
            self.codec,
            self.raw_length,
            self.queued_ns,
        )

    @classmethod
    def unpack(cls, raw: bytes) -> Entry:
        return cls(*_ENTRY.unpack(raw))


@dataclass(frozen=True)
class Backlog:
    """Chunks waiting for upload on this node (every process's)."""

    chunks: int
    bytes: int
    oldest_queued_ns: int  # 0 when empty


@dataclass(frozen=True)
class Admission:
    """The outcome of ``CacheIndex.admit``; ``victims``: (key, entry) whose files the caller must unlink;
    ``uploading``: the victims an uploader held a claim on (their upload may still finish)."""

    admitted: bool
    victims: tuple[tuple[str, Entry], ...] = ()
    uploading: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Eviction:
    """What ``CacheIndex.evict`` removed: (key, entry) whose files the caller must unlink, and the victims an
    uploader held a claim on (their upload may still finish)."""

    victims: tuple[tuple[str, Entry], ...] = ()
    uploading: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Removals:
    """What one process's calls removed from the cache since it last asked (``NVMeCache.take_removals``)."""

    evicted: int = 0
    lost_uploads: dict[str, int] = field(default_factory=dict)  # by reason: evicted, discarded, fsck, lost


class ChangeKind(IntEnum):
    """What happened to a chunk on this node, as the change log records it (for KV events)."""

    EVICTED = 1  # made room for others (budget or free space)
    REMOVED = 2  # proven bad, its file lost, or repaired away by fsck
    UPLOADED = 3  # its upload to the object store finished


@dataclass(frozen=True)
class Change:
    seq: int
    kind: ChangeKind
    key: str
    uploaded: bool = True  # False: an evicted or removed chunk whose only copy this was


def encode_key(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise CacheError(f"cache key must be a non-empty str, got {key!r}")
    raw = key.encode()
    if len(raw) > MAX_KEY_BYTES:
        raise CacheError(
            f"cache key is {len(raw)} bytes, longer than the {MAX_KEY_BYTES}-byte limit: {key[:80]!r}..."
        )
    return raw


@dataclass(frozen=True)
class CachedChunk:
    """Where a cached chunk lies and what its index entry vouches for. The file can still vanish before
    it is read (another process evicted it): ``read_into`` then answers GONE."""

    key: str
    path: str
    size: int
    checksum: bytes
    codec: int
    raw_length: int
    pending_upload: bool = False


@dataclass(frozen=True)
class CacheUsage:
    used_bytes: int
    budget_bytes: int
    entries: int
    pinned_entries: int


class ReadStatus(Enum):
    OK = "ok"
    GONE = "gone"  # the file vanished: another process evicted it, or it was lost
    CORRUPT = "corrupt"  # proven damage (checksum, truncation, key): the copy should be discarded
    UNREADABLE = "unreadable"  # not for this reader's buffer (another buffer size): left alone
    REPLACED = "replaced"  # the file is not the chunk its entry vouches for (another version): dropped
    FAILED = "failed"  # an I/O error; nothing is known about the copy


@dataclass(frozen=True)
class ReadResult:
    status: ReadStatus
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is ReadStatus.OK


@dataclass(frozen=True)
class StagedFile:
    """A chunk file written by ``write_file`` and not committed yet: nobody's until ``commit``."""

    key: str
    entry: Entry
    path: str
