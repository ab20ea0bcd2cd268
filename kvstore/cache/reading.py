"""Reading a cached chunk back: into the caller's buffer, verified against its index entry alone (a load), or
whole as it is stored (what an upload PUTs).

An entry holds the chunk's content checksum (over its key and raw bytes), codec and raw length, so an
uncompressed chunk is read with O_DIRECT straight into the caller's buffer, no header read, and hashed in
place. A file swapped for another key's, truncated or flipped fails that check. ``read_into`` reports what it
found and changes nothing; the caller decides (the engine discards corrupt copies and counts them).
"""

from __future__ import annotations

from kvstore.cache.files import ChunkFiles
from kvstore.cache.records import CachedChunk, ReadResult, ReadStatus
from kvstore.chunk import HEADER_BLOCK, Codec, content_checksum, decode_into, flat, stored_size
from kvstore.errors import CacheError, ChunkCorrupt, ChunkUnreadable

_OK = ReadResult(ReadStatus.OK)


def read_into(files: ChunkFiles, located: CachedChunk, dest: memoryview) -> ReadResult:
    """Read and verify the chunk into ``dest`` (exactly its raw length). Changes nothing: on CORRUPT
    the caller discards, on GONE or REPLACED it ``forget``s. ``dest`` holds garbage unless the result is
    OK."""
    out = flat(dest)
    if len(out) != located.raw_length:
        return ReadResult(ReadStatus.UNREADABLE, f"chunk holds {located.raw_length} bytes, buffer {len(out)}")
    try:
        if located.codec == Codec.NONE:
            if located.size != stored_size(located.raw_length):
                return ReadResult(ReadStatus.CORRUPT, "index entry size differs from its raw length")
            got = files.read_into(located.path, HEADER_BLOCK, out)
            if got != len(out):
                return ReadResult(ReadStatus.CORRUPT, f"truncated file: {got} of {len(out)} bytes")
            if content_checksum(located.key, out) != located.checksum:
                return ReadResult(ReadStatus.CORRUPT, "checksum mismatch")
            return _OK
        blob = files.read_whole(located.path, located.size)
        if len(blob) != located.size:
            return ReadResult(ReadStatus.CORRUPT, f"truncated file: {len(blob)} of {located.size} bytes")
        header = decode_into(located.key, blob, out)
        if header.checksum != located.checksum:
            return ReadResult(ReadStatus.CORRUPT, "file differs from its index entry")
        return _OK
    except FileNotFoundError:
        return ReadResult(ReadStatus.GONE)
    except ChunkCorrupt as exc:
        return ReadResult(ReadStatus.CORRUPT, str(exc))
    except ChunkUnreadable as exc:
        if located.pending_upload:
            # Its only copy, maybe a newer kvstore's on this node mid-upgrade: left for readers that can.
            return ReadResult(ReadStatus.UNREADABLE, str(exc))
        # Not the file the index admitted, and the bucket has the chunk: a node-local copy that would only
        # ever cost a read before each miss.
        return ReadResult(ReadStatus.REPLACED, str(exc))
    except OSError as exc:
        return ReadResult(ReadStatus.FAILED, str(exc))


def read_stored(files: ChunkFiles, located: CachedChunk) -> memoryview:
    """The whole chunk file as stored (what an upload PUTs), in this thread's staging buffer: valid
    until this thread's next read. FileNotFoundError if it is gone, CacheError if it is torn, another
    OSError if it cannot be read now (too many open files, no memory, a disk error): that proves nothing
    about the chunk, which may be the only copy."""
    blob = files.read_whole(located.path, located.size)
    if len(blob) != located.size:
        raise CacheError(f"{located.path} is {len(blob)} bytes, its index entry says {located.size}")
    return blob
