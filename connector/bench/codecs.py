"""Each codec's ratio and speed on bf16-like chunks: what `codec` costs and saves (part of `bench tiers`)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstore.chunk import Codec, decode, encode


@dataclass
class CodecResult:
    codec: str
    ratio: float  # raw bytes / stored bytes (header block and padding included)
    encode_gb_s: float
    decode_gb_s: float  # decode and verify


def bf16_chunk(nbytes: int, seed: int) -> bytes:
    """KV-like bytes: normal values truncated to bf16, the regime real K/V activations live in."""
    values = np.random.default_rng(seed).standard_normal(nbytes // 2).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _best_of(repeats: int, run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _encode(key: str, raw: bytes, codec: Codec) -> bytes:
    return encode(key, raw, codec).to_bytes()


def bench_codecs(chunk_bytes: int = 2 << 20, repeats: int = 3) -> list[CodecResult]:
    raw = bf16_chunk(chunk_bytes, 7)
    key = "bench/codec.bin"
    out = []
    for codec in Codec:
        blob = encode(key, raw, codec).to_bytes()
        enc_s = _best_of(repeats, functools.partial(_encode, key, raw, codec))
        dec_s = _best_of(repeats, functools.partial(decode, key, blob))
        gb = len(raw) / 1e9
        out.append(CodecResult(codec.name.lower(), len(raw) / len(blob), gb / enc_s, gb / dec_s))
    return out
