"""The object path of a new node: chunks in the S3 store and an empty NVMe cache, timed from the first lookup
to the last byte loaded, the tier driven the way vLLM's scheduler drives it (lookups every step until
answered, one load job per step for what was answered); against the raw baseline, parallel GETs of the same
objects with the best S3 client here and as many threads as our tier's io workers. That client is the data
path's own (`kvstore.stores.s3_get`): a raw loop of obstore GETs that keep no bytes took 1.3-2x its CPU per
GET here (research, 2026-12-05)."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob

from kvstore.agent.uploads import wait_uploaded
from kvstore.connector.bench.target import StoreTarget
from kvstore.connector.bench.thread_cpu import cpu_by_role, thread_cpu
from kvstore.connector.bench.tier_driver import (
    STEP_S,
    Primary,
    Timed,
    close_tier,
    end_step,
    keys_for,
    make_jobs,
    our_tier,
    run_jobs,
)

__all__ = ["ObjectPathResult", "bench_object_path"]


@dataclass
class ObjectPathResult:
    chunk_bytes: int
    chunks: int
    end_to_end_gb_s: float  # first lookup to last byte loaded, fresh node
    raw_get_gb_s: float  # raw parallel GETs of the same objects (the best client here)
    vs_raw: float
    cpu_us: float = 0.0  # CPU microseconds per chunk of the calling process (median over rounds)
    raw_cpu_us: float = 0.0  # ... of the raw GET loop
    # GETs (and HEADs) the S3 server counted per chunk loaded: ours (probes and loads) and the raw loop's.
    gets_per_chunk: float | None = None
    raw_gets_per_chunk: float | None = None
    usd_per_million_chunks: float | None = None  # our requests at S3's list prices, per chunk loaded
    # Where that CPU went, by thread: the scheduler's (lookups every step), our io threads' (GETs off the
    # socket, checks), obstore's runtime (HEADs, PUTs), ... (`kvstore.connector.bench.thread_cpu`).
    cpu_us_by_thread: dict[str, float] = field(default_factory=dict)
    raw_cpu_us_by_thread: dict[str, float] = field(default_factory=dict)


def _scheduler_loads(tier: SecondaryTierManager, keys: Sequence[OffloadKey], first_row: int) -> Timed:
    """From the first lookup to the last load reported, as vLLM's scheduler drives a tier: every step it
    looks up what is not loaded yet, submits one load job for what became a HIT, and polls."""
    req = ReqContext(req_id="bench-object")
    tier.on_new_request(req)
    for position, key in enumerate(keys):
        req.set_offload_key_position(key, (position + 1) * 128)
    todo = list(range(len(keys)))
    in_flight: set[int] = set()
    job_id = 200_000
    threads = thread_cpu()
    cpu = time.process_time()
    start = time.perf_counter()
    while todo or in_flight:
        for result in tier.get_finished_jobs():
            in_flight.discard(result.job_id)
            if not result.success:
                raise RuntimeError("an object-store load failed")
        hits: list[int] = []
        waiting: list[int] = []
        for i in todo:
            found = tier.lookup(keys[i], req)
            if found is LookupResult.MISS:
                raise RuntimeError("a chunk in the store is a miss")
            (hits if found is LookupResult.HIT else waiting).append(i)
        if hits:
            job_id += 1
            tier.submit_load(
                TransferJob(
                    job_id, [keys[i] for i in hits], np.asarray([first_row + i for i in hits]), True, req
                )
            )
            in_flight.add(job_id)
        todo = waiting
        end_step(tier, scheduled_tokens=0)  # a new node's request waits: nothing else runs
        time.sleep(STEP_S)
    return Timed(time.perf_counter() - start, time.process_time() - cpu, cpu_by_role(threads, thread_cpu()))


def bench_object_path(
    chunk_bytes: int,
    chunks: int,
    *,
    target: StoreTarget,
    rounds: int,
    workers: int,
    workdir: Path,
) -> ObjectPathResult:
    """A new node's loads from the S3 store of `target`, against raw parallel GETs of the same objects."""
    primary = Primary(chunk_bytes, 2 * chunks)
    primary.fill(chunks, seed=chunk_bytes + 1)
    keys = keys_for(f"object-{chunk_bytes}-{time.time_ns()}", chunks)
    raw_pool = ThreadPoolExecutor(workers, thread_name_prefix="raw-get")
    raw_get = _raw_gets(target, _seed(primary, keys, target, workdir), raw_pool)
    ours: list[Timed] = []
    baseline: list[Timed] = []
    asked: dict[str, float] = {}
    try:
        for _ in range(rounds):
            before = target.requests()
            baseline.append(raw_get())
            after = target.requests()
            if before is not None and after is not None:
                asked["raw"] = (after - before).get / chunks
            root = Path(tempfile.mkdtemp(prefix="fresh-node-", dir=workdir))
            tier = our_tier(primary, root, target.store_url, s3_endpoint=target.endpoint or "")
            try:
                before = target.requests()
                ours.append(_scheduler_loads(tier, keys, chunks))
                after = target.requests()
                if before is not None and after is not None:
                    counted = after - before
                    asked["ours"], asked["usd"] = counted.get / chunks, counted.usd_per_million(chunks)
                bad = [i for i in range(chunks) if not primary.same(i, chunks + i)]
                if bad:
                    raise RuntimeError(f"{len(bad)} chunks loaded wrong bytes from the object store")
            finally:
                close_tier(tier)
                shutil.rmtree(root, ignore_errors=True)
            primary.map[chunks * chunk_bytes :] = bytes(chunks * chunk_bytes)
    finally:
        raw_pool.shutdown()
        primary.close()
    total = chunk_bytes * chunks / 1e9
    best_ours, best_raw = min(t.seconds for t in ours), min(t.seconds for t in baseline)
    return ObjectPathResult(
        chunk_bytes=chunk_bytes,
        chunks=chunks,
        end_to_end_gb_s=total / best_ours,
        raw_get_gb_s=total / best_raw,
        vs_raw=best_raw / best_ours,
        cpu_us=statistics.median(t.cpu_s for t in ours) / chunks * 1e6,
        raw_cpu_us=statistics.median(t.cpu_s for t in baseline) / chunks * 1e6,
        gets_per_chunk=asked.get("ours"),
        raw_gets_per_chunk=asked.get("raw"),
        usd_per_million_chunks=asked.get("usd"),
        cpu_us_by_thread=_per_chunk_by_thread(ours, chunks),
        raw_cpu_us_by_thread=_per_chunk_by_thread(baseline, chunks),
    )


def _per_chunk_by_thread(runs: Sequence[Timed], chunks: int) -> dict[str, float]:
    """CPU microseconds per chunk of each thread role, the median over rounds, the largest first."""
    roles = {role for run in runs for role in run.cpu_by_thread}
    median = {role: statistics.median(run.cpu_by_thread.get(role, 0.0) for run in runs) for role in roles}
    return {role: round(s / chunks * 1e6, 1) for role, s in sorted(median.items(), key=lambda kv: -kv[1])}


def _seed(primary: Primary, keys: Sequence[OffloadKey], target: StoreTarget, workdir: Path) -> list[str]:
    """Store rows 0.. of `primary` under `keys` through our tier on a node of its own, wait until its agent
    uploaded them, and drop that node: the chunks' object names, in the S3 store alone."""
    root = Path(tempfile.mkdtemp(prefix="seed-", dir=workdir))
    seeder = our_tier(primary, root, target.store_url, s3_endpoint=target.endpoint or "")
    try:
        run_jobs(seeder, make_jobs(keys, range(len(keys)), 16, 1), load=False)
        if not wait_uploaded(seeder.engine.cache, 600):
            raise RuntimeError("seeding the object store did not finish")
        return [seeder.namespace.chunk_key(k) for k in keys]
    finally:
        close_tier(seeder)
        shutil.rmtree(root, ignore_errors=True)


def _raw_gets(target: StoreTarget, names: Sequence[str], pool: ThreadPoolExecutor) -> Callable[[], Timed]:
    """The raw baseline: one call GETs every object of `names` from `target`'s bucket with the data path's
    own client, on the threads of `pool` (as many as our tier's io workers, and like them alive before and
    after), and says how long that took."""
    from kvstore.stores.s3 import S3Options
    from kvstore.stores.s3_get import ObjectGetter

    bucket, prefix = target.bucket_and_prefix
    prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    raw = ObjectGetter(
        bucket,
        endpoint=target.endpoint,
        access_key=target.access_key,
        secret_key=target.secret_key,
        session_token=None,
        region="us-east-1",
        options=S3Options().for_gets(),
    )

    def size_of(name: str) -> int:
        body = raw.get(prefix + name, "raw GET")
        return 0 if body is None else len(body)

    def raw_get() -> Timed:
        threads = thread_cpu()
        cpu = time.process_time()
        start = time.perf_counter()
        sizes = list(pool.map(size_of, names))
        seconds = time.perf_counter() - start
        assert all(sizes)
        return Timed(seconds, time.process_time() - cpu, cpu_by_role(threads, thread_cpu()))

    return raw_get
