"""The chunk format: round trips for every codec, and every kind of damage is an error, never bytes."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.chunk import HEADER_SIZE, Codec, checksum, decode, decode_into, encode, parse_header
from kvstore.errors import ChecksumMismatch, ChunkError, ChunkFormatError, ConfigError


def bf16_like(n: int, seed: int = 0) -> bytes:
    values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


@pytest.mark.parametrize("codec", list(Codec))
def test_round_trip(codec: Codec) -> None:
    raw = bf16_like(50_000)
    blob = encode(raw, codec)
    header = parse_header(blob)
    assert header.codec is codec and header.raw_length == len(raw) and header.checksum == checksum(raw)
    assert decode(blob) == raw
    out = bytearray(len(raw))
    decode_into(blob, memoryview(out))
    assert bytes(out) == raw


def test_zstd_shuffle_compresses_bf16() -> None:
    raw = bf16_like(1 << 18)
    assert len(encode(raw, Codec.ZSTD)) < 0.8 * len(raw)


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=4096), codec=st.sampled_from(list(Codec)), width=st.sampled_from([1, 2, 4]))
def test_round_trip_any_bytes(raw: bytes, codec: Codec, width: int) -> None:
    assert decode(encode(raw, codec, element_width=width)) == raw


@settings(max_examples=150, deadline=None)
@given(data=st.data(), codec=st.sampled_from(list(Codec)))
def test_any_single_byte_flip_is_rejected(data: st.DataObject, codec: Codec) -> None:
    raw = bf16_like(2048, seed=1)
    blob = bytearray(encode(raw, codec))
    pos = data.draw(st.integers(0, len(blob) - 1))
    blob[pos] ^= data.draw(st.integers(1, 255))
    # Reserved header bytes carry no meaning; everything else must be caught.
    if 40 <= pos < HEADER_SIZE or pos == 7:
        assert decode(bytes(blob)) == raw
        return
    with pytest.raises(ChunkError):
        decode(bytes(blob))


@pytest.mark.parametrize("codec", list(Codec))
def test_truncation_is_rejected(codec: Codec) -> None:
    blob = encode(bf16_like(4096), codec)
    for cut in (0, 10, HEADER_SIZE, len(blob) - 1):
        with pytest.raises(ChunkFormatError):
            decode(blob[:cut])
    with pytest.raises(ChunkFormatError):
        decode(bytes(blob) + b"\0")


def test_malformed_headers() -> None:
    blob = bytearray(encode(b"abcd" * 100))
    with pytest.raises(ChunkFormatError, match="magic"):
        decode(b"XXXX" + bytes(blob[4:]))
    wrong_version = bytes(blob[:4]) + b"\x09" + bytes(blob[5:])
    with pytest.raises(ChunkFormatError, match="version"):
        decode(wrong_version)
    wrong_codec = bytes(blob[:5]) + b"\x07" + bytes(blob[6:])
    with pytest.raises(ChunkFormatError, match="codec"):
        decode(wrong_codec)
    struct.pack_into("<Q", blob, 8, 12345)
    with pytest.raises(ChunkFormatError):
        decode(bytes(blob))


def test_checksum_mismatch_is_specific() -> None:
    blob = bytearray(encode(b"x" * 1000))
    blob[-1] ^= 0xFF
    with pytest.raises(ChecksumMismatch):
        decode(bytes(blob))


@pytest.mark.parametrize("size", [0, 1, 65_535, 65_536, 65_537, 3 * 65_536 + 7, 1 << 20])
def test_checksum_in_pieces_equals_one_shot_xxh3(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert checksum(data) == xxhash.xxh3_128_digest(data)
    assert checksum(memoryview(np.frombuffer(data, dtype=np.uint8))) == xxhash.xxh3_128_digest(data)


def test_destination_of_wrong_size() -> None:
    blob = encode(b"y" * 100)
    with pytest.raises(ChunkFormatError, match="destination"):
        decode_into(blob, memoryview(bytearray(99)))


def test_codec_names() -> None:
    assert Codec.parse("zstd") is Codec.ZSTD and Codec.parse("NONE") is Codec.NONE
    with pytest.raises(ConfigError, match="codec"):
        Codec.parse("lz5")


def test_checksum_in_one_call_equals_the_piecewise_one() -> None:
    data = os.urandom(256 * 1024 + 7)
    assert checksum(data, release_gil=True) == checksum(data) == xxhash.xxh3_128_digest(data)
