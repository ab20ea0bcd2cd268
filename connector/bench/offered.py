"""`kvstore bench offered`: what a tier persists when stores come at a fixed rate, as a GPU engine sends them.

vLLM hands a tier a store job per request per step and keeps the chunks' primary-tier rows busy until the job
reports. A tier slower than the offered rate runs the primary tier out of free rows, and what cannot be
offloaded then is simply not kept. So each run offers chunks at a fixed rate for a fixed time through the tier
API, from a bounded pool of primary rows (a row is free again when its job reports), and reports:
  - the fraction of the offered bytes persisted to NVMe (jobs reported successful), and, for our tier, in the
    object store (a `file://` store on the same disk) at the end of the window and after the journal drains;
  - drops by reason: no free primary row, failed jobs, uploads lost to eviction;
  - the scheduler thread's wall time per step in the tier's calls.
vLLM's `fs` tier runs the same schedule in the same run. The memory run stores a fixed amount as fast as the
tier takes it, each tier in a fresh process, and reports page cache and RSS growth.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from queue import Empty

import numpy as np
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob

from kvstore.agent.uploads import wait_uploaded
from kvstore.cache import NVMeCache
from kvstore.connector.bench.disk import dd_bandwidth
from kvstore.connector.bench.tier_driver import Primary, close_tier, fs_tier, keys_for, our_tier

_STEP_S = 0.01
_CACHE_BYTES = 16 << 30
_DRAIN_S = 120.0  # how long the journal may take to drain after the window (then what is in the store counts)


@dataclass
class OfferedResult:
    tier: str
    rate_gb_s: float
    seconds: float
    offered_chunks: int
    persisted_nvme: float  # fraction of offered
    persisted_object_at_end: float | None  # fraction in the object store when the window closed
    persisted_object_after_drain: float | None
    dropped_primary_full: int
    failed_jobs_chunks: int
    uploads_lost: int
    step_ms_mean: float
    step_ms_p99: float


@dataclass
class MemoryResult:
    tier: str
    stored_gib: float
    page_cache_growth_mib: float
    rss_growth_mib: float


@dataclass
class OfferedReport:
    chunk_bytes: int
    rows: int
    dd_write_gb_s: float = 0.0
    runs: list[OfferedResult] = field(default_factory=list)
    memory: list[MemoryResult] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _offer(
    tier: SecondaryTierManager, primary: Primary, rows: int, rate: float, seconds: float, tag: str
) -> tuple[int, int, int, int, list[float]]:
    """Offer stores at `rate` bytes/s for `seconds`: (offered, persisted, dropped for lack of rows, failed
    chunks, per-step scheduler seconds)."""
    chunk = primary.chunk_bytes
    free = list(range(rows))
    held: dict[int, list[int]] = {}
    req = ReqContext(req_id="offered")
    offered = persisted = no_row = failed = 0
    credit = 0.0
    step_s: list[float] = []
    # Made as the window needs them (a fast rate for long offers millions; a list of 10**7 took 10 s to make).
    keys = itertools.chain.from_iterable(keys_for(f"{tag}-{block}", 1024) for block in itertools.count())
    job_id = 0
    start = last = time.perf_counter()
    while True:
        now = time.perf_counter()
        window_open = now - start < seconds
        if not window_open and not held:
            break
        if not window_open and now - start > seconds + 60:
            break  # jobs that never report: counted as not persisted
        t0 = time.perf_counter()
        for result in tier.get_finished_jobs():
            done = held.pop(result.job_id)
            free.extend(done)
            if result.success:
                persisted += len(done)
            else:
                failed += len(done)
        if window_open:
            credit += rate * (now - last)
            want = int(credit // chunk)
            credit -= want * chunk
            offered += want
            take = min(want, len(free))
            no_row += want - take
            if take:
                job_rows = [free.pop() for _ in range(take)]
                job_id += 1
                held[job_id] = job_rows
                tier.submit_store(
                    TransferJob(job_id, [next(keys) for _ in job_rows], np.asarray(job_rows), False, req)
                )
        tier.on_schedule_end(None)  # type: ignore[arg-type]  # the standalone scheduler has no context
        step_s.append(time.perf_counter() - t0)
        last = now
        time.sleep(max(0.0, _STEP_S - (time.perf_counter() - now)))
    return offered, persisted, no_row, failed, step_s


def _objects_in(root: Path) -> int:
    return sum(1 for p in (root / "store").rglob("*.bin") if p.is_file()) if (root / "store").exists() else 0


def run_offered(
    *,
    chunk_bytes: int,
    rows: int,
    rates: Sequence[float],
    seconds: float,
    workdir: Path,
    progress: Callable[[str], None],
) -> list[OfferedResult]:
    primary = Primary(chunk_bytes, rows)
    primary.fill(rows, seed=3)
    out: list[OfferedResult] = []
    try:
        for rate in rates:
            for side in ("fs", "ours"):
                progress(f"{side}: {rate / 1e9:.2f} GB/s offered for {seconds:.0f} s")
                root = Path(tempfile.mkdtemp(prefix=f"offered-{side}-", dir=workdir))
                try:
                    out.append(_one_run(side, primary, rows, rate, seconds, root))
                finally:
                    shutil.rmtree(root, ignore_errors=True)
    finally:
        primary.close()
    return out


def _one_run(
    side: str, primary: Primary, rows: int, rate: float, seconds: float, root: Path
) -> OfferedResult:
    if side == "fs":
        tier: SecondaryTierManager = fs_tier(primary, root)
    else:
        # A real node's budget: evictions happen, and what is evicted before its upload is counted.
        tier = our_tier(primary, root, (root / "store").as_uri(), cache_bytes=_CACHE_BYTES)
    at_end = after_drain = None
    lost = 0
    try:
        offered, persisted, no_row, failed, steps = _offer(
            tier, primary, rows, rate, seconds, f"{side}-{rate}"
        )
        if side == "ours":
            at_end = _objects_in(root) / max(offered, 1)
            engine = tier.engine  # type: ignore[attr-defined]
            wait_uploaded(engine.cache, _DRAIN_S)  # the node agent's uploads
            after_drain = _objects_in(root) / max(offered, 1)
    finally:
        close_tier(tier)  # the agent takes the engine's last figures before it stops
    if side == "ours":
        with NVMeCache(root / "nvme", _CACHE_BYTES) as cache:  # node-wide: the engine's and the agent's
            lost = cache.counters().get("uploads_lost", 0)
    ordered = sorted(steps)
    return OfferedResult(
        tier=side,
        rate_gb_s=rate / 1e9,
        seconds=seconds,
        offered_chunks=offered,
        persisted_nvme=persisted / max(offered, 1),
        persisted_object_at_end=at_end,
        persisted_object_after_drain=after_drain,
        dropped_primary_full=no_row,
        failed_jobs_chunks=failed,
        uploads_lost=lost,
        step_ms_mean=statistics.mean(steps) * 1e3 if steps else 0.0,
        step_ms_p99=ordered[int(0.99 * (len(ordered) - 1))] * 1e3 if ordered else 0.0,
    )


# -- memory: page cache and RSS growth while a tier stores a fixed amount ---------------------------------


def _meminfo_kib(name: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise KeyError(name)


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise KeyError("VmRSS")


def _memory_child(
    side: str,
    chunk_bytes: int,
    rows: int,
    total: int,
    workdir: str,
    out: multiprocessing.Queue,  # type: ignore[type-arg]
) -> None:
    root = Path(tempfile.mkdtemp(prefix=f"memory-{side}-", dir=workdir))
    primary = Primary(chunk_bytes, rows)
    primary.fill(rows, seed=5)
    tier: SecondaryTierManager = (
        fs_tier(primary, root) if side == "fs" else our_tier(primary, root, (root / "store").as_uri())
    )
    cached0, rss0 = _meminfo_kib("Cached"), _rss_kib()
    peak_cache = peak_rss = 0
    try:
        req = ReqContext(req_id="memory")
        chunks = max(1, total // chunk_bytes)
        keys = iter(keys_for(f"memory-{side}", chunks))
        free = list(range(rows))
        held: dict[int, list[int]] = {}
        job_id = stored = 0
        while stored < chunks or held:
            for result in tier.get_finished_jobs():
                free.extend(held.pop(result.job_id))
            if stored < chunks and free:
                take = [free.pop() for _ in range(min(16, len(free), chunks - stored))]
                job_id += 1
                held[job_id] = take
                tier.submit_store(
                    TransferJob(job_id, [next(keys) for _ in take], np.asarray(take), False, req)
                )
                stored += len(take)
            tier.on_schedule_end(None)  # type: ignore[arg-type]
            peak_cache = max(peak_cache, _meminfo_kib("Cached") - cached0)
            peak_rss = max(peak_rss, _rss_kib() - rss0)
            time.sleep(0.001)
        if side == "ours":
            wait_uploaded(tier.engine.cache, 300)  # type: ignore[attr-defined]
        peak_cache = max(peak_cache, _meminfo_kib("Cached") - cached0)
    finally:
        close_tier(tier)
        primary.close()
        shutil.rmtree(root, ignore_errors=True)
    out.put(MemoryResult(side, chunks * chunk_bytes / (1 << 30), peak_cache / 1024, peak_rss / 1024))


def run_memory(*, chunk_bytes: int, rows: int, total: int, workdir: Path) -> list[MemoryResult]:
    ctx = multiprocessing.get_context("spawn")
    results: list[MemoryResult] = []
    for side in ("fs", "ours"):
        queue: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
        child = ctx.Process(target=_memory_child, args=(side, chunk_bytes, rows, total, str(workdir), queue))
        child.start()
        results.append(_result_of(child, queue, side, deadline_s=1800))
        child.join(60)
    return results


def _result_of(
    child: multiprocessing.process.BaseProcess,
    queue: multiprocessing.Queue,  # type: ignore[type-arg]
    side: str,
    *,
    deadline_s: float,
) -> MemoryResult:
    """The child's result; a child that died without one is an error at once, not a wait to the deadline."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            result: MemoryResult = queue.get(timeout=1)
            return result
        except Empty:
            if not child.is_alive():
                raise RuntimeError(f"the {side} memory run died (exit code {child.exitcode})") from None
    child.kill()
    raise RuntimeError(f"the {side} memory run gave no result in {deadline_s:.0f} s")


def run_offered_bench(
    *,
    chunk_bytes: int,
    rows: int,
    rates: Sequence[float],
    seconds: float,
    memory_bytes: int,
    workdir: Path | None = None,
    progress: Callable[[str], None] = lambda _msg: None,
) -> OfferedReport:
    report = OfferedReport(chunk_bytes=chunk_bytes, rows=rows)
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-offered-", dir=workdir))
    try:
        progress("raw disk (O_DIRECT dd)")
        report.dd_write_gb_s = dd_bandwidth(root).dd_write_gb_s
        if rates:
            report.runs = run_offered(
                chunk_bytes=chunk_bytes,
                rows=rows,
                rates=rates,
                seconds=seconds,
                workdir=root,
                progress=progress,
            )
        if memory_bytes:
            progress(f"memory: {memory_bytes / (1 << 30):.1f} GiB stored by each tier, in a fresh process")
            report.memory = run_memory(chunk_bytes=chunk_bytes, rows=rows, total=memory_bytes, workdir=root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return report
