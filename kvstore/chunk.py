"""The chunk format: how one KV chunk is laid out in a file or an object (version 2).

A chunk is self-describing, versioned and bound to its key, so any reader can check it before trusting a
byte, and a valid chunk stored under another key's name is never served as that key's KV::

    offset  size  field (little-endian)
    0       4     magic b"KVCH"
    4       1     format version (2)
    5       1     codec (0 = none, 1 = zstd over byte-shuffled data)
    6       1     element width used by the shuffle (2 for bf16/fp16; 1 = no shuffle)
    7       1     flags (0)
    8       4     payload offset (4096)
    12      2     key length K (UTF-8 bytes)
    14      2     reserved (0)
    16      8     raw length: bytes after decoding
    24      8     payload length: stored bytes, before the padding
    32      16    content checksum: xxh3-128 of (domain tag, K, key, raw bytes)
    48      8     header checksum: xxh3-64 of bytes 0..47 and the key
    56      K     key
    ...           zeros up to 4096
    4096    ...   payload, zero-padded to a multiple of 4096

The header fills a 4 KiB block of its own and the payload is padded to whole blocks, so a file or an object
moves with O_DIRECT straight between the device and vLLM's primary region, and an uncompressed payload can
be read into its destination with no copy. The content checksum covers the raw bytes and the key; it is
verified after decompression, so it does not depend on the codec.

What a reader may do with a bad chunk follows from the error (see `kvstore.errors`): `ChunkCorrupt` is
proven damage to a chunk of this version (checksum, key, lengths, truncation) and may be deleted;
`ChunkUnreadable` (not a kvstore chunk, a newer version or codec, another buffer size) and `LegacyChunk`
(version 1, not bound to its key) are misses that leave the chunk alone.

Why shuffle: bf16/fp8 KV values look random byte by byte, but their high (sign/exponent) bytes are highly
repetitive. Splitting each element's bytes into separate planes lets zstd find that structure.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import TypeAlias

import numpy as np
import xxhash
import zstandard

from kvstore.errors import (
    ChecksumMismatch,
    ChunkFormatError,
    ChunkUnreadable,
    ConfigError,
    KeyMismatch,
    LegacyChunk,
)

MAGIC = b"KVCH"
FORMAT_VERSION = 2
BLOCK = 4096  # the alignment unit of O_DIRECT: header block, payload offset, padded payload
HEADER_BLOCK = BLOCK
MAX_KEY_BYTES = 2048
_FIXED = struct.Struct("<4sBBBBIHHQQ16s")  # everything before the header checksum
_HEADER_CHECKSUM_AT = _FIXED.size
_KEY_AT = _HEADER_CHECKSUM_AT + 8
_DOMAIN = b"kvstore-chunk-v2\0"
assert _KEY_AT + MAX_KEY_BYTES <= HEADER_BLOCK

# Anything with the buffer protocol that holds bytes: chunks come from vLLM's region, mmaps and clients.
Buffer: TypeAlias = bytes | bytearray | memoryview | mmap.mmap


class Codec(IntEnum):
    NONE = 0
    ZSTD = 1  # zstd over byte-shuffled data

    @classmethod
    def parse(cls, name: str) -> Codec:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ConfigError(f"codec: unknown codec {name!r}; expected one of none, zstd") from None


def align_up(n: int) -> int:
    """`n` rounded up to whole 4 KiB blocks."""
    return (n + BLOCK - 1) & ~(BLOCK - 1)


def stored_size(payload_length: int) -> int:
    """Bytes of a chunk file or object whose payload is `payload_length` bytes."""
    return HEADER_BLOCK + align_up(payload_length)


def flat(buf: Buffer) -> memoryview:
    """A 1-D unsigned-byte view of `buf`, without a copy."""
    view = memoryview(buf)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _key_bytes(key: str) -> bytes:
    raw = key.encode()
    if not raw or len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"chunk key must be 1-{MAX_KEY_BYTES} UTF-8 bytes, got {len(raw)}")
    return raw


def content_checksum(key: str, raw: Buffer) -> bytes:
    """xxh3-128 over the key and the raw bytes (~40 GB/s; hashing a large buffer releases the GIL)."""
    kb = _key_bytes(key)
    hasher = xxhash.xxh3_128(_DOMAIN + len(kb).to_bytes(2, "little") + kb)
    hasher.update(flat(raw))
    return hasher.digest()


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    key: str
    codec: Codec
    element_width: int
    raw_length: int
    payload_length: int
    checksum: bytes

    @property
    def total_length(self) -> int:
        """Bytes of the whole chunk: header block plus padded payload."""
        return stored_size(self.payload_length)

    def pack(self) -> bytes:
        """The 4 KiB header block."""
        kb = _key_bytes(self.key)
        block = bytearray(HEADER_BLOCK)
        _FIXED.pack_into(
            block,
            0,
            MAGIC,
            FORMAT_VERSION,
            self.codec,
            self.element_width,
            0,
            HEADER_BLOCK,
            len(kb),
            0,
            self.raw_length,
            self.payload_length,
            self.checksum,
        )
        block[_KEY_AT : _KEY_AT + len(kb)] = kb
        block[_HEADER_CHECKSUM_AT:_KEY_AT] = _header_checksum(block, len(kb))
        return bytes(block)

    def verify(self, raw: Buffer) -> None:
        """ChecksumMismatch unless `raw` is this chunk's content."""
        if content_checksum(self.key, raw) != self.checksum:
            raise ChecksumMismatch(f"chunk {self.key}: checksum mismatch, the stored bytes are corrupt")


def _header_checksum(block: Buffer, key_length: int) -> bytes:
    hasher = xxhash.xxh3_64(block[:_HEADER_CHECKSUM_AT])
    hasher.update(block[_KEY_AT : _KEY_AT + key_length])
    return hasher.digest()


def parse_header(buf: Buffer, key: str | None = None) -> ChunkHeader:
    """Parse and check the header at the start of `buf`; with `key`, the chunk must be that key's."""
    view = flat(buf)
    if len(view) < 5 or bytes(view[:4]) != MAGIC:
        raise ChunkUnreadable("not a kvstore chunk (no KVCH magic)")
    version = view[4]
    if version == 1:
        raise LegacyChunk("a version-1 chunk is not bound to its key; `kvstore migrate` upgrades it")
    if version != FORMAT_VERSION:
        raise ChunkUnreadable(f"chunk format version {version}; this build reads {FORMAT_VERSION}")
    if len(view) < _KEY_AT:
        raise ChunkFormatError(f"truncated chunk: {len(view)} bytes, the header needs more")
    (_, _, codec, width, _, offset, key_length, _, raw_len, payload_len, digest) = _FIXED.unpack_from(view)
    if key_length == 0 or key_length > MAX_KEY_BYTES or len(view) < _KEY_AT + key_length:
        raise ChunkFormatError(f"chunk header holds a bad key length {key_length}")
    if bytes(view[_HEADER_CHECKSUM_AT:_KEY_AT]) != _header_checksum(view, key_length):
        raise ChecksumMismatch("chunk header checksum mismatch: the header is corrupt")
    try:
        parsed_codec = Codec(codec)
    except ValueError:
        raise ChunkUnreadable(f"unknown codec id {codec}") from None
    try:
        stored_key = bytes(view[_KEY_AT : _KEY_AT + key_length]).decode()
    except UnicodeDecodeError:
        raise ChunkFormatError("chunk header key is not UTF-8") from None
    if offset != HEADER_BLOCK or width not in (1, 2, 4, 8):
        raise ChunkFormatError(f"inconsistent chunk header (payload offset {offset}, element width {width})")
    if parsed_codec is Codec.NONE and (payload_len != raw_len or width != 1):
        raise ChunkFormatError("uncompressed chunk with a payload length or element width that is not raw")
    if key is not None and stored_key != key:
        raise KeyMismatch(f"the chunk stored as {key} is {stored_key}'s")
    return ChunkHeader(stored_key, parsed_codec, width, raw_len, payload_len, digest)


@dataclass(frozen=True, slots=True)
class EncodedChunk:
    """A chunk ready to write: its header block, then the payload (a view of the caller's raw bytes when
    uncompressed), then zero padding."""

    header: ChunkHeader
    header_block: bytes
    payload: memoryview

    @property
    def total_length(self) -> int:
        return self.header.total_length

    def parts(self) -> list[bytes | memoryview]:
        pad = self.header.total_length - HEADER_BLOCK - len(self.payload)
        return [self.header_block, self.payload, bytes(pad)] if pad else [self.header_block, self.payload]

    def to_bytes(self) -> bytes:
        """The whole chunk as one buffer (a copy), for stores that take a single body."""
        return b"".join(self.parts())


def encode(
    key: str,
    raw: Buffer,
    codec: Codec = Codec.NONE,
    *,
    element_width: int = 2,
    level: int = 1,
) -> EncodedChunk:
    """Wrap `raw` as `key`'s chunk. Uncompressed, the payload is `raw` itself: no copy is made, so `raw`
    must stay unchanged until the chunk is written."""
    raw_view = flat(raw)
    digest = content_checksum(key, raw_view)
    if codec is Codec.NONE:
        width, payload = 1, raw_view
    else:
        width = element_width if element_width > 1 and len(raw_view) % element_width == 0 else 1
        shuffled = _shuffle(raw_view, width) if width > 1 else raw_view
        payload = memoryview(zstandard.ZstdCompressor(level=level).compress(shuffled))
    header = ChunkHeader(key, codec, width, len(raw_view), len(payload), digest)
    return EncodedChunk(header, header.pack(), payload)


def _shuffle(raw: memoryview, width: int) -> bytes:
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, width).T.tobytes()


def copy_bytes(src: Buffer, dest: memoryview) -> None:
    """`dest[:] = src` through numpy, which copies without holding the GIL."""
    np.copyto(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def unpack_into(header: ChunkHeader, payload: bytes | memoryview, dest: memoryview) -> None:
    """Decode `payload` (exactly `header.payload_length` bytes) into `dest` and verify it."""
    header.verify(unpack_verified(header, payload, dest))


def unpack_verified(header: ChunkHeader, payload: bytes | memoryview, dest: memoryview) -> memoryview:
    """Decode a payload that `verify` has already checked into `dest`, returned flat. Decoding immutable
    bytes is deterministic, so hashing what it wrote a second time would find nothing new."""
    out = flat(dest)
    if len(out) != header.raw_length:
        raise ChunkUnreadable(f"destination holds {len(out)} bytes, chunk decodes to {header.raw_length}")
    if header.codec is Codec.NONE:
        copy_bytes(payload, out)
        return out
    try:
        data = zstandard.ZstdDecompressor().decompress(payload, max_output_size=header.raw_length)
    except zstandard.ZstdError as exc:
        raise ChunkFormatError(f"corrupt zstd payload: {exc}") from None
    if len(data) != header.raw_length:
        raise ChunkFormatError(f"payload decodes to {len(data)} bytes, header says {header.raw_length}")
    target = np.frombuffer(out, dtype=np.uint8)
    planes = np.frombuffer(data, dtype=np.uint8)
    width = header.element_width
    if width == 1:
        target[:] = planes
    else:
        target.reshape(-1, width)[:] = planes.reshape(width, -1).T
    return out


def _validate(view: memoryview, key: str) -> ChunkHeader:
    """Header plus the length checks that must pass before anything is allocated from its numbers."""
    header = parse_header(view, key)
    if len(view) != header.total_length:
        raise ChunkFormatError(f"chunk is {len(view)} bytes, its header says {header.total_length}")
    if header.codec is Codec.ZSTD:
        try:
            content_size = zstandard.frame_content_size(view[HEADER_BLOCK:])
        except zstandard.ZstdError as exc:
            raise ChunkFormatError(f"corrupt zstd frame: {exc}") from None
        if content_size != header.raw_length:
            raise ChunkFormatError(f"zstd frame holds {content_size} bytes, header says {header.raw_length}")
    return header


def payload_of(header: ChunkHeader, blob: Buffer) -> memoryview:
    return flat(blob)[HEADER_BLOCK : HEADER_BLOCK + header.payload_length]


def decode_into(key: str, blob: Buffer, dest: memoryview) -> ChunkHeader:
    """Verify `blob` as `key`'s chunk and write its raw bytes into `dest` (exactly the raw length).

    On error `dest` may hold garbage; the caller must treat the slot as not loaded."""
    view = flat(blob)
    header = _validate(view, key)
    unpack_into(header, payload_of(header, view), dest)
    return header


def verify(key: str, blob: Buffer) -> ChunkHeader:
    """Check `blob` as `key`'s chunk without a destination (an uncompressed payload is hashed in place)."""
    view = flat(blob)
    header = _validate(view, key)
    if header.codec is Codec.NONE:
        header.verify(payload_of(header, view))
    else:
        unpack_into(header, payload_of(header, view), memoryview(bytearray(header.raw_length)))
    return header


def decode(key: str, blob: Buffer) -> bytes:
    """Verify `blob` as `key`'s chunk and return its raw bytes."""
    header = _validate(flat(blob), key)
    out = bytearray(header.raw_length)
    unpack_into(header, payload_of(header, blob), memoryview(out))
    return bytes(out)


# -- version 1, read only by `kvstore migrate` and `fsck` ------------------------------------------------

_V1_HEADER = struct.Struct("<4sBBBxQQ16s24x")  # magic, version, codec, width, raw len, payload len, xxh3-128


def decode_legacy(blob: Buffer) -> tuple[bytes, Codec, int]:
    """The raw bytes, codec and element width of a version-1 chunk, verified against its own checksum
    (which covers the raw bytes only: whose key it is, the chunk cannot tell)."""
    view = flat(blob)
    if len(view) < _V1_HEADER.size:
        raise ChunkFormatError("truncated version-1 chunk")
    magic, version, codec_id, width, raw_len, payload_len, digest = _V1_HEADER.unpack_from(view)
    if magic != MAGIC or version != 1:
        raise ChunkUnreadable("not a version-1 kvstore chunk")
    if len(view) != _V1_HEADER.size + payload_len:
        raise ChunkFormatError("version-1 chunk length differs from its header")
    try:
        codec = Codec(codec_id)
    except ValueError:
        raise ChunkUnreadable(f"unknown codec id {codec_id}") from None
    payload = view[_V1_HEADER.size :]
    if codec is Codec.NONE:
        raw = bytes(payload)
    else:
        try:
            planes = zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            raise ChunkFormatError(f"corrupt zstd payload: {exc}") from None
        arr = np.frombuffer(planes, dtype=np.uint8)
        raw = arr.reshape(width, -1).T.tobytes() if width > 1 and len(arr) else arr.tobytes()
    if len(raw) != raw_len or xxhash.xxh3_128_digest(raw) != digest:
        raise ChecksumMismatch("version-1 chunk checksum mismatch")
    return raw, codec, width


def encode_legacy(raw: bytes, codec: Codec = Codec.NONE, *, element_width: int = 2) -> bytes:
    """A version-1 chunk, for tests and migrations that must produce what older releases wrote."""
    width = 1
    payload: bytes = raw
    if codec is Codec.ZSTD:
        width = element_width if element_width > 1 and len(raw) % element_width == 0 else 1
        shuffled = _shuffle(memoryview(raw), width) if width > 1 else raw
        payload = zstandard.ZstdCompressor(level=1).compress(shuffled)
    head = _V1_HEADER.pack(MAGIC, 1, codec, width, len(raw), len(payload), xxhash.xxh3_128_digest(raw))
    return head + payload
