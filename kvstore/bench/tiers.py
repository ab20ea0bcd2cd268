"""`kvstore bench tiers`: the engine's load paths beside raw baselines on the same data, in one run.

For each chunk size: store N chunks through the engine (NVMe + upload), then
  - NVMe hit:   engine.load_into (verify included)  vs  raw parallel readinto of the very same files;
  - object hit: engine.load_into on a node with no NVMe  vs  raw parallel GETs of the same objects with the
                same client and the same parallelism.
Also: lookups of 100k index-resident keys (us/key), and each codec's ratio and speed on bf16-like data.
Results are ratios against the baselines; absolute numbers on shared machines are noise.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvstore.cache import NVMeCache
from kvstore.chunk import Codec, decode, encode
from kvstore.engine import TieredStore
from kvstore.metrics import EngineMetrics
from kvstore.stores import ObjectStore

MiB = 1 << 20


@dataclass
class SizeResult:
    chunk_bytes: int
    chunks: int
    store_mb_s: float
    nvme_load_mb_s: float
    raw_file_read_mb_s: float
    nvme_vs_raw: float
    object_load_mb_s: float
    raw_get_mb_s: float
    object_vs_raw: float


@dataclass
class CodecResult:
    codec: str
    ratio: float
    encode_mb_s: float
    decode_mb_s: float


@dataclass
class TiersReport:
    sizes: list[SizeResult] = field(default_factory=list)
    lookup_keys: int = 0
    lookup_us_per_key: float = 0.0
    index_contains_us_per_key: float = 0.0
    codecs: list[CodecResult] = field(default_factory=list)
    data: str = "synthetic bf16: standard-normal values rounded to bfloat16 (no real KV cache available)"
    workers: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


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


def _read_file(path: str, out: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(out):
            n = f.readinto(out[done:])
            if not n:
                break
            done += n


def bench_size(
    store: ObjectStore, workdir: Path, chunk_bytes: int, chunks: int, workers: int, repeats: int
) -> SizeResult:
    prefix = f"bench/{chunk_bytes}-{os.getpid()}-{time.time_ns()}"
    keys = [f"{prefix}/{i:06d}.bin" for i in range(chunks)]
    payloads = [bf16_chunk(chunk_bytes, i) for i in range(chunks)]
    total_mb = chunk_bytes * chunks / MiB
    buffers = [memoryview(bytearray(chunk_bytes)) for _ in range(chunks)]
    metrics = EngineMetrics.for_registry(None)
    cache_dir = workdir / f"cache-{chunk_bytes}"
    with NVMeCache(cache_dir, budget_bytes=chunk_bytes * chunks * 2 + 64 * MiB) as cache:
        engine = TieredStore(
            store, cache, io_workers=workers, metrics=metrics, upload_queue_bytes=chunk_bytes * chunks * 2
        )
        start = time.perf_counter()
        engine.store_many(list(zip(keys, payloads, strict=True)))
        engine.flush(timeout=600)
        store_s = time.perf_counter() - start
        located = [cache.locate(k) for k in keys]
        paths = [loc.path for loc in located if loc is not None]
        assert len(paths) == chunks, "every stored chunk must be on NVMe"
        with ThreadPoolExecutor(workers) as pool:

            def raw_read() -> None:
                list(pool.map(_read_file, paths, buffers))

            def engine_read() -> None:
                assert all(engine.load_into(list(zip(keys, buffers, strict=True))))

            raw_read()  # warm the page cache the same way for both
            raw_s = _best_of(repeats, raw_read)
            nvme_s = _best_of(repeats, engine_read)
        engine.close()
    assert bytes(buffers[0]) == payloads[0]

    remote_only = TieredStore(store, None, io_workers=workers, metrics=metrics)
    with ThreadPoolExecutor(workers) as pool:

        def raw_get() -> None:
            assert all(b is not None for b in pool.map(store.get, keys))

        def engine_get() -> None:
            assert all(remote_only.load_into(list(zip(keys, buffers, strict=True))))

        raw_get()
        get_s = _best_of(repeats, raw_get)
        object_s = _best_of(repeats, engine_get)
    remote_only.close()
    store.delete_many(keys)
    return SizeResult(
        chunk_bytes=chunk_bytes,
        chunks=chunks,
        store_mb_s=total_mb / store_s,
        nvme_load_mb_s=total_mb / nvme_s,
        raw_file_read_mb_s=total_mb / raw_s,
        nvme_vs_raw=raw_s / nvme_s,
        object_load_mb_s=total_mb / object_s,
        raw_get_mb_s=total_mb / get_s,
        object_vs_raw=get_s / object_s,
    )


def bench_lookup(workdir: Path, n_keys: int) -> tuple[float, float]:
    """us/key for engine.lookup and for the bare index, over keys that are all NVMe-resident."""
    blob = encode(b"\0" * 64)
    keys = [f"bench-lookup/{i:032x}.bin" for i in range(n_keys)]
    with NVMeCache(workdir / "lookup-cache", budget_bytes=len(blob) * n_keys * 2) as cache:
        for key in keys:
            cache.put(key, blob)
        engine = TieredStore(None, cache, metrics=EngineMetrics.for_registry(None))
        batch = 1000
        start = time.perf_counter()
        for i in range(0, n_keys, batch):
            engine.lookup(keys[i : i + batch], wait=False)
        engine_us = (time.perf_counter() - start) / n_keys * 1e6
        start = time.perf_counter()
        for i in range(0, n_keys, batch):
            cache.contains_many(keys[i : i + batch])
        index_us = (time.perf_counter() - start) / n_keys * 1e6
        engine.close()
    return engine_us, index_us


def bench_codecs(chunk_bytes: int, repeats: int) -> list[CodecResult]:
    raw = bf16_chunk(chunk_bytes, 7)
    out = []
    for codec in Codec:
        blob = encode(raw, codec)
        enc_s = _best_of(repeats, functools.partial(encode, raw, codec))
        dec_s = _best_of(repeats, functools.partial(decode, blob))
        mb = len(raw) / MiB
        out.append(CodecResult(codec.name.lower(), len(raw) / len(blob), mb / enc_s, mb / dec_s))
    return out


def run_tiers_bench(
    store: ObjectStore,
    *,
    sizes: list[int],
    total_bytes: int,
    lookup_keys: int,
    workers: int,
    repeats: int,
    workdir: Path | None = None,
    progress: Callable[[str], None] = lambda _msg: None,
) -> TiersReport:
    report = TiersReport(workers=workers, lookup_keys=lookup_keys)
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=workdir) as tmp:
        root = Path(tmp)
        for size in sizes:
            chunks = max(4, total_bytes // size)
            progress(f"chunks of {size // 1024} KiB x {chunks}")
            report.sizes.append(bench_size(store, root, size, chunks, workers, repeats))
        progress(f"lookup of {lookup_keys} resident keys")
        report.lookup_us_per_key, report.index_contains_us_per_key = bench_lookup(root, lookup_keys)
        progress("codecs")
        report.codecs = bench_codecs(2 * MiB, repeats)
    return report
