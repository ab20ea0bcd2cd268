"""The chunk format: round trips for every codec; every kind of damage is an error, never bytes; a chunk is
bound to its key; and the error says whether a reader may delete what it found."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.chunk import (
    BLOCK,
    HEADER_BLOCK,
    Codec,
    content_checksum,
    decode,
    decode_into,
    decode_legacy,
    encode,
    encode_legacy,
    parse_header,
    verify,
)
from kvstore.errors import (
    ChecksumMismatch,
    ChunkCorrupt,
    ChunkError,
    ChunkFormatError,
    ChunkUnreadable,
    ConfigError,
    KeyMismatch,
    LegacyChunk,
)

KEY = "model_0123456789ab_r0/abc/de_g0/abcdef.bin"


def bf16_like(n: int, seed: int = 0) -> bytes:
    values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


@pytest.mark.parametrize("codec", list(Codec))
def test_round_trip(codec: Codec) -> None:
    raw = bf16_like(50_000)
    blob = encode(KEY, raw, codec).to_bytes()
    header = parse_header(blob, KEY)
    assert header.codec is codec and header.raw_length == len(raw) and header.key == KEY
    assert header.checksum == content_checksum(KEY, raw)
    assert decode(KEY, blob) == raw
    out = bytearray(len(raw))
    decode_into(KEY, blob, memoryview(out))
    assert bytes(out) == raw


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 256 * 1024])
def test_layout_is_whole_blocks_with_the_payload_in_a_block_of_its_own(size: int) -> None:
    raw = bytes(range(256)) * (size // 256) + bytes(size % 256)
    chunk = encode(KEY, raw)
    blob = chunk.to_bytes()
    assert len(chunk.header_block) == HEADER_BLOCK == BLOCK
    assert len(blob) % BLOCK == 0 and len(blob) == chunk.total_length
    assert blob[HEADER_BLOCK : HEADER_BLOCK + size] == raw  # uncompressed: the raw bytes, at offset 4096
    assert blob[HEADER_BLOCK + size :] == bytes(len(blob) - HEADER_BLOCK - size)


def test_uncompressed_payload_is_the_callers_memory_not_a_copy() -> None:
    raw = bytearray(b"x" * 8192)
    chunk = encode(KEY, raw)
    raw[0] = ord("y")
    assert chunk.payload[0] == ord("y")


def test_zstd_shuffle_compresses_bf16() -> None:
    raw = bf16_like(1 << 18)
    assert encode(KEY, raw, Codec.ZSTD).header.payload_length < 0.8 * len(raw)


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=4096), codec=st.sampled_from(list(Codec)), width=st.sampled_from([1, 2, 4]))
def test_round_trip_any_bytes(raw: bytes, codec: Codec, width: int) -> None:
    assert decode(KEY, encode(KEY, raw, codec, element_width=width).to_bytes()) == raw


@settings(max_examples=200, deadline=None)
@given(data=st.data(), codec=st.sampled_from(list(Codec)))
def test_any_meaningful_byte_flip_is_rejected(data: st.DataObject, codec: Codec) -> None:
    raw = bf16_like(2048, seed=1)
    chunk = encode(KEY, raw, codec)
    blob = bytearray(chunk.to_bytes())
    header_end = 56 + len(KEY.encode())
    payload_end = HEADER_BLOCK + chunk.header.payload_length
    pos = data.draw(st.one_of(st.integers(0, header_end - 1), st.integers(HEADER_BLOCK, payload_end - 1)))
    blob[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(ChunkError):
        decode(KEY, bytes(blob))


def test_padding_carries_no_meaning() -> None:
    raw = b"z" * 1000
    blob = bytearray(encode(KEY, raw).to_bytes())
    blob[HEADER_BLOCK - 1] ^= 0xFF  # after the key, inside the header block
    blob[-1] ^= 0xFF  # payload padding
    assert decode(KEY, bytes(blob)) == raw


def test_a_chunk_under_another_keys_name_is_rejected() -> None:
    blob = encode(KEY, b"kv of one prefix" * 100).to_bytes()
    with pytest.raises(KeyMismatch):
        decode("model_0123456789ab_r0/abc/de_g0/000000.bin", blob)
    with pytest.raises(KeyMismatch):
        verify("other.bin", blob)
    assert issubclass(KeyMismatch, ChunkCorrupt)


def _with_header_checksum(blob: bytearray) -> bytes:
    """Fix up the header checksum after a deliberate header change (what a newer writer would produce)."""
    import xxhash

    key_length = struct.unpack_from("<H", blob, 12)[0]
    hasher = xxhash.xxh3_64(bytes(blob[:48]))
    hasher.update(bytes(blob[56 : 56 + key_length]))
    blob[48:56] = hasher.digest()
    return bytes(blob)


def test_the_checksum_covers_the_key() -> None:
    raw = b"same bytes" * 100
    assert content_checksum("a.bin", raw) != content_checksum("b.bin", raw)
    # A forger renames a.bin's chunk inside its header, keeping its content checksum and fixing the header's
    # own checksum: the content checksum, which covers the key, still gives it away.
    original = encode("a.bin", raw)
    forged = bytearray(encode("b.bin", raw).to_bytes())
    forged[32:48] = original.header.checksum
    with pytest.raises(ChecksumMismatch):
        decode("b.bin", _with_header_checksum(forged))


@pytest.mark.parametrize("codec", list(Codec))
def test_truncation_and_extension_are_corruption(codec: Codec) -> None:
    blob = encode(KEY, bf16_like(4096), codec).to_bytes()
    for cut in (10, 60, HEADER_BLOCK, len(blob) - 1):
        with pytest.raises(ChunkFormatError):
            decode(KEY, blob[:cut])
    with pytest.raises(ChunkFormatError):
        decode(KEY, blob + b"\0")
    assert issubclass(ChunkFormatError, ChunkCorrupt)


def test_what_a_reader_cannot_interpret_is_unreadable_not_corrupt() -> None:
    blob = bytearray(encode(KEY, b"abcd" * 100).to_bytes())
    cases = {
        "magic": b"XXXX" + bytes(blob[4:]),
        "short": bytes(blob[:3]),
        "newer version": bytes(blob[:4]) + b"\x09" + bytes(blob[5:]),
        "unknown codec": _with_header_checksum(bytearray(blob[:5]) + b"\x07" + blob[6:]),
    }
    for name, bad in cases.items():
        with pytest.raises(ChunkUnreadable) as caught:
            decode(KEY, bad)
        assert not isinstance(caught.value, ChunkCorrupt), name
    with pytest.raises(ChunkUnreadable, match="destination"):
        decode_into(KEY, bytes(blob), memoryview(bytearray(399)))


def test_checksum_mismatch_is_corruption() -> None:
    blob = bytearray(encode(KEY, b"x" * 1000).to_bytes())
    blob[HEADER_BLOCK] ^= 0xFF
    with pytest.raises(ChecksumMismatch):
        decode(KEY, bytes(blob))
    assert issubclass(ChecksumMismatch, ChunkCorrupt)


@pytest.mark.parametrize("codec", list(Codec))
def test_version_1_chunks_are_legacy_and_migratable(codec: Codec) -> None:
    raw = bf16_like(3000, seed=4)
    old = encode_legacy(raw, codec)
    with pytest.raises(LegacyChunk):
        decode(KEY, old)
    assert not issubclass(LegacyChunk, ChunkCorrupt)
    again, found_codec, _ = decode_legacy(old)
    assert again == raw and found_codec is codec
    damaged = bytearray(old)
    damaged[-1] ^= 1
    with pytest.raises(ChunkError):
        decode_legacy(bytes(damaged))


def test_codec_names() -> None:
    assert Codec.parse("zstd") is Codec.ZSTD and Codec.parse("NONE") is Codec.NONE
    with pytest.raises(ConfigError, match="codec"):
        Codec.parse("lz5")
