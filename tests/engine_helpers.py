"""Chunks for the engine's and the agent's tests: payloads that look like bf16 KV, keys, and the data path's
load into fresh buffers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.chunk import encode
from kvstore.engine import TieredStore
from kvstore.stores import ObjectStore

CHUNK = 64 * 1024


def payload(i: int) -> bytes:
    values = np.random.default_rng(i).standard_normal(CHUNK // 2).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def keys(n: int, tag: str = "k") -> list[str]:
    return [f"ns_abc_r0/{tag}/{i:04d}.bin" for i in range(n)]


def fill(store: ObjectStore, names: Sequence[str], first: int = 0) -> None:
    for i, name in enumerate(names):
        store.put(name, encode(name, payload(first + i)).to_bytes())


def load(engine: TieredStore, names: Sequence[str], size: int = CHUNK) -> list[bytes | None]:
    bufs = [memoryview(bytearray(size)) for _ in names]
    ok = engine.load_into(list(zip(names, bufs, strict=True)))
    return [bytes(b) if good else None for b, good in zip(bufs, ok, strict=True)]
