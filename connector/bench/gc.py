"""`kvstore bench gc`: fill a bucket with N tiny chunk objects plus access records, then time one GC run.

Generation writes real objects (parallel PUTs of tiny bodies on a thread pool). All objects are written
"now", so the bench moves GC's clock forward instead of waiting: a fraction of the chunks get access records
recent enough to survive the TTL, the rest are idle and deleted; with `budget_fraction` set, the survivors are
then cut to that share of their bytes oldest-first, so both passes are measured. Peak RSS comes from
`getrusage` (the process high-water mark, which includes generation) and, optionally, `tracemalloc`'s peak of
Python allocations during the GC run alone (slower, but it isolates GC's own memory).
"""

from __future__ import annotations

import hashlib
import random
import resource
import sys
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvstore.access import encode_batch
from kvstore.gc import run_gc
from kvstore.layout import ACCESS_PREFIX
from kvstore.stores import ObjectStore

__all__ = ["bench_chunk_key", "generate_bucket", "run_gc_bench"]

_RECORD_KEYS = 50_000  # keys per access record, the recorder's default batch size


def bench_chunk_key(i: int, namespace: str = "bench_000000000000") -> str:
    h = hashlib.blake2b(i.to_bytes(8, "big"), digest_size=16).hexdigest()
    return f"{namespace}_r0/{h[:3]}/{h[3:5]}_g0/{h}.bin"


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def generate_bucket(store: ObjectStore, objects: int, *, object_bytes: int = 64, workers: int = 32) -> float:
    """Write `objects` chunk objects of `object_bytes` each; return the seconds it took."""
    body = b"\x5a" * object_bytes
    start = time.perf_counter()
    step = 500  # one task per slice keeps the executor's queue (and its memory) small

    def put_slice(first: int) -> None:
        for i in range(first, min(first + step, objects)):
            store.put(bench_chunk_key(i), body)

    with ThreadPoolExecutor(workers, thread_name_prefix="bench-gc-put") as pool:
        list(pool.map(put_slice, range(0, objects, step)))
    return time.perf_counter() - start


def run_gc_bench(
    store: ObjectStore,
    objects: int = 200_000,
    *,
    object_bytes: int = 64,
    accessed_fraction: float = 0.3,
    budget_fraction: float | None = 0.5,
    workers: int = 32,
    dry_run: bool = False,
    trace_memory: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Generate the bucket, run GC once and return the numbers (and GC's own report under `report`).

    With the defaults, 70% of the chunks are idle past the TTL and the budget pass removes half of the
    remaining bytes; `store` should be empty (an existing bucket's objects would be collected too)."""
    if objects <= 0:
        raise ValueError("objects must be > 0")
    if not 0.0 <= accessed_fraction <= 1.0:
        raise ValueError("accessed_fraction must be in [0, 1]")
    gen_s = generate_bucket(store, objects, object_bytes=object_bytes, workers=workers)
    written_at = time.time()

    # Access records: recent enough (within the TTL at GC's clock) for the accessed fraction, at spread-out
    # times so the budget pass has an order to follow.
    ttl = 5_000.0
    gc_now = written_at + 10_000.0
    rng = random.Random(seed)
    accessed = [i for i in range(objects) if rng.random() < accessed_fraction]
    by_ts: dict[int, list[str]] = {}
    for i in accessed:
        by_ts.setdefault(rng.randrange(6_000, 9_000, 60), []).append(bench_chunk_key(i))
    records = 0
    for offset, keys in sorted(by_ts.items()):
        for start in range(0, len(keys), _RECORD_KEYS):
            records += 1
            name = f"{ACCESS_PREFIX}bench/{records:06d}.json.zst"
            store.put(name, encode_batch(keys[start : start + _RECORD_KEYS], written_at + offset))
    max_bytes = None
    if budget_fraction is not None:
        max_bytes = max(1, int(len(accessed) * object_bytes * budget_fraction))

    rss_before = _peak_rss_mb()
    if trace_memory:
        tracemalloc.start()
    gc_start = time.perf_counter()
    report = run_gc(
        store, ttl_seconds=ttl, max_bytes=max_bytes, grace_seconds=600, dry_run=dry_run, now=gc_now
    )
    gc_s = time.perf_counter() - gc_start
    traced_peak_mb = None
    if trace_memory:
        traced_peak_mb = tracemalloc.get_traced_memory()[1] / (1 << 20)
        tracemalloc.stop()
    return {
        "objects": objects,
        "object_bytes": object_bytes,
        "accessed": len(accessed),
        "access_records": records,
        "generate_s": round(gen_s, 3),
        "generate_objects_per_s": round(objects / gen_s, 1),
        "gc_wall_s": round(gc_s, 3),
        "gc_objects_per_s": round(objects / gc_s, 1),
        "deleted": report.deleted,
        "deleted_ttl": report.deleted_ttl,
        "deleted_budget": report.deleted_budget,
        "remaining_objects": report.remaining_objects,
        "peak_rss_mb_before_gc": round(rss_before, 1),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "gc_traced_peak_mb": None if traced_peak_mb is None else round(traced_peak_mb, 2),
        "dry_run": dry_run,
        "report": report.as_dict(),
    }
