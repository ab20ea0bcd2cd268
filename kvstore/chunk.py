"""The chunk format: how one KV chunk is laid out in a file or an object.

A chunk is self-describing and versioned, so any reader can check it before trusting a byte::

    offset  size  field
    0       4     magic  b"KVCH"
    4       1     format version (1)
    5       1     codec  (0 = none, 1 = zstd over byte-shuffled data)
    6       1     element width used by the shuffle (2 for bf16/fp16, 1 = no shuffle)
    7       1     reserved (0)
    8       8     raw length      (little-endian u64, bytes after decoding)
    16      8     payload length  (little-endian u64, bytes after the header)
    24      16    xxh3-128 of the raw bytes
    40      24    reserved (0); the header is 64 bytes so the payload starts cache-line aligned
    64      ...   payload

The checksum covers the *raw* bytes, so it is verified after decompression and is independent of the codec.
Every decode verifies it; anything malformed, truncated or mismatching raises a `ChunkError` and never
returns bytes.

Why shuffle: bf16/fp8 KV values look random byte by byte, but their high (sign/exponent) bytes are highly
repetitive. Splitting each element's bytes into separate planes lets zstd find that structure.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import xxhash
import zstandard

from kvstore.errors import ChecksumMismatch, ChunkFormatError, ConfigError

MAGIC = b"KVCH"
FORMAT_VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<4sBBBxQQ16s24x")
assert _HEADER.size == HEADER_SIZE


class Codec(IntEnum):
    NONE = 0
    ZSTD = 1  # zstd over byte-shuffled data

    @classmethod
    def parse(cls, name: str) -> Codec:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ConfigError(f"codec: unknown codec {name!r}; expected one of none, zstd") from None


@dataclass(frozen=True)
class ChunkHeader:
    codec: Codec
    element_width: int
    raw_length: int
    payload_length: int
    checksum: bytes

    @property
    def total_length(self) -> int:
        return HEADER_SIZE + self.payload_length


# Hash in pieces of at most 64 KiB: xxhash hands the GIL away for anything larger, and on the load path inside
# vLLM every hand-off can cost a wait for the busy scheduler thread that dwarfs the ~3 us the piece takes to
# hash. The same pieces keep copy-and-verify in the CPU cache: one pass over memory instead of two.
_PIECE = 64 * 1024


def checksum(data: bytes | memoryview, *, release_gil: bool = False) -> bytes:
    """xxh3-128 of `data` (~20+ GB/s, so verifying every read costs little next to the copy itself).

    `release_gil`: hash in one call, which lets other threads run meanwhile. For write-behind work (stores),
    where yielding to the scheduler thread matters more than getting the GIL back quickly."""
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if release_gil or len(view) <= _PIECE:
        return xxhash.xxh3_128_digest(view)
    hasher = xxhash.xxh3_128()
    for start in range(0, len(view), _PIECE):
        hasher.update(view[start : start + _PIECE])
    return hasher.digest()


def copy_verified(src: bytes | memoryview, dest: memoryview, expected: bytes) -> None:
    """Copy `src` into `dest` (same length) while checksumming it; ChecksumMismatch if it differs."""
    hasher = xxhash.xxh3_128()
    source = memoryview(src)
    for start in range(0, len(dest), _PIECE):
        piece = dest[start : start + _PIECE]
        piece[:] = source[start : start + _PIECE]
        hasher.update(piece)
    if hasher.digest() != expected:
        raise ChecksumMismatch("chunk checksum mismatch: the stored bytes are corrupt")


def parse_header(buf: bytes | bytearray | memoryview) -> ChunkHeader:
    """Parse and sanity-check the 64-byte header at the start of `buf`."""
    if len(buf) < HEADER_SIZE:
        raise ChunkFormatError(f"truncated chunk: {len(buf)} bytes, header needs {HEADER_SIZE}")
    magic, version, codec, width, raw_len, payload_len, digest = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ChunkFormatError(f"not a chunk: bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise ChunkFormatError(
            f"unsupported chunk format version {version} (this build reads {FORMAT_VERSION})"
        )
    try:
        parsed_codec = Codec(codec)
    except ValueError:
        raise ChunkFormatError(f"unknown codec id {codec}") from None
    if width not in (1, 2, 4, 8):
        raise ChunkFormatError(f"invalid element width {width}")
    if parsed_codec is Codec.NONE and (payload_len != raw_len or width != 1):
        raise ChunkFormatError("uncompressed chunk with a payload length or element width that is not raw")
    return ChunkHeader(parsed_codec, width, raw_len, payload_len, digest)


def _shuffle(raw: bytes | memoryview, width: int) -> bytes:
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(-1, width).T
    return planes.tobytes()


def encode(
    raw: bytes | memoryview,
    codec: Codec = Codec.NONE,
    *,
    element_width: int = 2,
    level: int = 1,
) -> memoryview:
    """Wrap `raw` in a chunk (a read-only buffer). `element_width` is the KV dtype's size (2 for bf16)."""
    raw_view = memoryview(raw).cast("B")
    digest = checksum(raw_view, release_gil=True)  # chunks are encoded by writers, never on a load path
    if codec is Codec.NONE:
        width, payload = 1, raw_view
    else:
        width = element_width if element_width > 1 and len(raw_view) % element_width == 0 else 1
        shuffled = _shuffle(raw_view, width) if width > 1 else raw_view
        payload = memoryview(zstandard.ZstdCompressor(level=level).compress(shuffled))
    blob = np.empty(HEADER_SIZE + len(payload), dtype=np.uint8)
    _HEADER.pack_into(blob.data, 0, MAGIC, FORMAT_VERSION, codec, width, len(raw_view), len(payload), digest)
    # numpy copies without holding the GIL (bytes concatenation would hold it for the whole copy): inside
    # vLLM every stored chunk passes through here, on threads that share the GIL with the scheduler.
    blob[HEADER_SIZE:] = np.frombuffer(payload, dtype=np.uint8)
    return blob.data.toreadonly()


def decode_into(blob: bytes | memoryview, dest: memoryview) -> None:
    """Verify `blob` and write its raw bytes into `dest`, which must be exactly the raw length.

    On error `dest` may hold garbage; the caller must treat the slot as not loaded.
    """
    view = memoryview(blob).cast("B")
    header = _validate(view)
    out = dest.cast("B") if dest.format != "B" or dest.ndim != 1 else dest
    if len(out) != header.raw_length:
        raise ChunkFormatError(f"destination holds {len(out)} bytes, chunk decodes to {header.raw_length}")
    payload = view[HEADER_SIZE:]
    if header.codec is Codec.NONE:
        copy_verified(payload, out, header.checksum)
        return
    else:
        try:
            data = zstandard.ZstdDecompressor().decompress(payload, max_output_size=header.raw_length)
        except zstandard.ZstdError as exc:
            raise ChunkFormatError(f"corrupt zstd payload: {exc}") from None
        if len(data) != header.raw_length:
            raise ChunkFormatError(f"payload decodes to {len(data)} bytes, header says {header.raw_length}")
        width = header.element_width
        target = np.frombuffer(out, dtype=np.uint8)
        if width == 1:
            target[:] = np.frombuffer(data, dtype=np.uint8)
        else:
            target.reshape(-1, width)[:] = np.frombuffer(data, dtype=np.uint8).reshape(width, -1).T
    if checksum(out) != header.checksum:
        raise ChecksumMismatch("chunk checksum mismatch: the stored bytes are corrupt")


def _validate(view: memoryview) -> ChunkHeader:
    """Header plus the length checks that must pass before anything is allocated from its numbers."""
    header = parse_header(view)
    if len(view) != header.total_length:
        raise ChunkFormatError(f"chunk length {len(view)} != header + payload {header.total_length}")
    if header.codec is Codec.ZSTD:
        try:
            content_size = zstandard.frame_content_size(view[HEADER_SIZE:])
        except zstandard.ZstdError as exc:
            raise ChunkFormatError(f"corrupt zstd frame: {exc}") from None
        if content_size != header.raw_length:
            raise ChunkFormatError(f"zstd frame holds {content_size} bytes, header says {header.raw_length}")
    return header


def decode(blob: bytes | memoryview) -> bytes:
    """Verify `blob` and return its raw bytes."""
    header = _validate(memoryview(blob).cast("B"))
    out = bytearray(header.raw_length)
    decode_into(blob, memoryview(out))
    return bytes(out)
