"""`kvstore bench vllm`: what the tier buys inside a real vLLM engine, against vLLM's own tiers.

TTFT of long prompts, in one run, when the prefix is
  - recomputed (no offloading),
  - loaded by vLLM's built-in `fs` tier (fresh engine, same directory),
  - loaded by KVStoreTier from the node's NVMe cache (fresh engine, same cache),
  - loaded by KVStoreTier from the object store alone (fresh engine, empty cache: a new node),
  - loaded by vLLM's own object-store tier (`obj`, NIXL) from the same S3 server (fresh engine).
Each engine first runs a short unrelated warm-up prompt, so TTFT excludes first-request effects; TTFT is
the time of a `max_tokens=1` request, the median over the prompts. Before each timed engine, what it will
read is dropped from the page cache: the fs tier's files, our NVMe cache, and the local S3 server's objects
(a node's disk holds far more than its RAM, and a bucket's objects are on its own disks); an S3 endpoint of
another machine is left as it is. The methods run in the order given (rotate it between runs: the machine
warms up). For the methods that read a bucket, the S3 requests the server counted per chunk loaded; for
our new node, where each request's time went (`kvstore.engine.timeline`).

Also the scheduler-thread cost of the tier per step with 1000+ chunks in flight, measured outside the
engine with vLLM's own job classes (everything the scheduler calls: lookup, submit, poll, events, stats).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.agent.supervisor import stop_agent
from kvstore.agent.uploads import wait_uploaded_in
from kvstore.connector.bench.disk import evict_page_cache
from kvstore.connector.bench.target import StoreTarget
from kvstore.connector.configs import CPU_BLOCK_TOKENS, cpu_tiering_config
from kvstore.connector.harness.engine_runner import EngineRun, run_engine
from kvstore.connector.harness.tiny_model import build_tiny_model, sample_text
from kvstore.engine import timeline as milestones
from kvstore.engine.timeline import Episode, Phase, episode_phases, read_timelines

TTFT_METHODS = ("recompute", "fs", "ours-nvme", "ours-bucket", "obj")
DESCRIPTIONS = {
    "recompute": "recompute",
    "fs": "vLLM fs tier",
    "ours-nvme": "KVStoreTier, NVMe hit",
    "ours-bucket": "KVStoreTier, object store only (new node)",
    "obj": "vLLM obj tier, object store (new engine)",
}
_MAX_MODEL_LEN = 16384  # the tiny model's positions: room for the seed's 12K-token prompt (--words 11000)


@dataclass
class TTFTRow:
    method: str
    ttft_s: float
    cached_tokens: int
    speedup_vs_recompute: float = 0.0
    vs_fs_tier: float = 0.0
    # Methods that read a bucket: what the S3 server was asked while the fresh engine ran (GET includes HEAD).
    s3_get: float | None = None
    s3_get_missing: float | None = None
    s3_put: float | None = None
    chunks_loaded: float = 0.0
    usd_per_million_chunks: float | None = None  # those requests at S3's list prices, per chunk loaded

    @property
    def gets_per_chunk(self) -> float | None:
        if self.s3_get is None or not self.chunks_loaded:
            return None
        return self.s3_get / self.chunks_loaded


@dataclass
class SchedulerCost:
    step_interval_ms: float
    loads_every_step: bool
    steps: int
    max_in_flight_chunks: int
    mean_ms_per_step: float  # wall time on the scheduler thread: our calls plus waits for the GIL
    p99_ms_per_step: float
    cpu_ms_per_step: float  # the scheduler thread's own CPU time in our calls, mean


@dataclass
class VLLMReport:
    prompt_tokens: int
    prompts: int
    methods: list[str] = field(default_factory=list)
    rows: list[TTFTRow] = field(default_factory=list)
    timeline: list[Phase] = field(default_factory=list)  # our new node's request, phase by phase
    timeline_counts: dict[str, float] = field(default_factory=dict)  # steps, lookups, jobs: medians
    s3_objects_cold: bool = False  # the local S3 server's objects were dropped from the page cache too
    chunk_tokens: int = CPU_BLOCK_TOKENS  # tokens per offloaded chunk, every method alike
    scheduler: list[SchedulerCost] = field(default_factory=list)
    link: str = ""  # the S3 server was reached through a link of this shape (`StoreTarget.link`)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _fill(model: Path, prompts: list[str], config: dict[str, Any], env: dict[str, str]) -> None:
    # A few decode steps after each prefill: offloads are submitted on the steps that follow.
    run_engine(
        model,
        prompts,
        kv_transfer_config=config,
        env=env,
        max_tokens=8,
        settle_s=2.0,
        max_model_len=_MAX_MODEL_LEN,
    )


def _ttft(model: Path, prompts: list[str], config: dict[str, Any] | None, env: dict[str, str]) -> EngineRun:
    return run_engine(
        model,
        [sample_text(50, seed=999), *prompts],
        kv_transfer_config=config,
        env=env,
        max_tokens=1,
        max_model_len=_MAX_MODEL_LEN,
    )


def _row(method: str, run: EngineRun) -> TTFTRow:
    cached = [r.num_cached_tokens for r in run.results[1:]]
    return TTFTRow(DESCRIPTIONS[method], statistics.median(run.generate_s[1:]), min(cached))


def bench_ttft(
    target: StoreTarget,
    *,
    words: int = 5600,
    prompts: int = 3,
    methods: Sequence[str] = TTFT_METHODS,
    workdir: Path | None = None,
    progress: Callable[[str], None] = print,
    chunk_tokens: int = 0,
) -> VLLMReport:
    unknown = sorted(set(methods) - set(TTFT_METHODS))
    if unknown or "recompute" not in methods or "fs" not in methods:
        raise ValueError(f"methods must include recompute and fs, from {', '.join(TTFT_METHODS)}")
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-vllm-", dir=workdir))
    env = dict(target.env)
    try:
        model = build_tiny_model(root / "tiny-llama")
        texts = [sample_text(words, seed=100 + i) for i in range(prompts)]
        ours = {
            "type": "KVStoreTier",
            "module_path": "kvstore.connector.tier",
            "store_url": f"{target.store_url.rstrip('/')}/ttft-{time.time_ns()}",
            "cache_dir": str(root / "nvme-a"),
        }
        if target.endpoint:
            ours["s3_endpoint"] = target.endpoint
        counted = run_engine(model, [texts[0]], max_tokens=1, max_model_len=_MAX_MODEL_LEN)
        tokens = counted.results[0].prompt_len
        report = VLLMReport(
            prompt_tokens=tokens,
            prompts=prompts,
            methods=list(methods),
            chunk_tokens=chunk_tokens or CPU_BLOCK_TOKENS,
            link=target.link,
        )

        def tiering(tier: dict[str, Any]) -> dict[str, Any]:
            return cpu_tiering_config(tier, chunk_tokens=chunk_tokens)

        report.s3_objects_cold = target.server_dir is not None
        rows: dict[str, TTFTRow] = {}
        for method in methods:
            if method == "recompute":
                progress("recompute (no offloading)")
                rows[method] = _row(method, _ttft(model, texts, None, env))
            elif method == "fs":
                progress("vLLM fs tier: fill, then a fresh engine")
                fs = tiering({"type": "fs", "root_dir": str(root / "fs")})
                _fill(model, texts, fs, env)
                evict_page_cache(root / "fs")
                rows[method] = _row(method, _ttft(model, texts, fs, env))
            elif method == "ours-nvme":
                progress("KVStoreTier: fill, then a fresh engine on the same NVMe cache")
                _fill(model, texts, tiering(ours), env)
                evict_page_cache(root / "nvme-a")
                rows[method] = _row(method, _ttft(model, texts, tiering(ours), env))
            elif method == "ours-bucket":
                progress("KVStoreTier: a fresh node (empty NVMe cache, same bucket)")
                if "ours-nvme" not in rows:
                    _fill(model, texts, tiering(ours), env)
                wait_uploaded_in(root / "nvme-a", 600)  # the node agent the tier started uploads them
                path = root / "timeline.jsonl"
                fresh = {**ours, "cache_dir": str(root / "nvme-b"), "timeline_path": str(path)}
                if target.server_dir is not None:
                    evict_page_cache(target.server_dir)
                rows[method], run = _counted(
                    method, target, model, texts, tiering(fresh), env, report.chunk_tokens
                )
                report.timeline, report.timeline_counts = phases(read_timelines(path)[-prompts:], run)
            else:
                progress("vLLM obj tier: fill, then a fresh engine")
                entry, obj_env = target.obj_tier(f"ttft-obj-{time.time_ns()}")
                _fill(model, texts, tiering(entry), obj_env)
                if target.server_dir is not None:
                    evict_page_cache(target.server_dir)
                rows[method], _ = _counted(
                    method, target, model, texts, tiering(entry), obj_env, report.chunk_tokens
                )
        recompute, fs_ttft = rows["recompute"].ttft_s, rows["fs"].ttft_s
        for method in methods:
            row = rows[method]
            row.speedup_vs_recompute, row.vs_fs_tier = recompute / row.ttft_s, row.ttft_s / fs_ttft
            report.rows.append(row)
        return report
    finally:
        for node in ("nvme-a", "nvme-b"):  # the node agents the tiers started outlive their engines
            stop_agent(root / node)
        shutil.rmtree(root, ignore_errors=True)


def _counted(
    method: str,
    target: StoreTarget,
    model: Path,
    texts: list[str],
    config: dict[str, Any],
    env: dict[str, str],
    chunk_tokens: int,
) -> tuple[TTFTRow, EngineRun]:
    """The method's row from a fresh engine's TTFT run, with the S3 requests the server counted meanwhile."""
    before = target.requests()
    done = _ttft(model, texts, config, env)
    after = target.requests()
    row = _row(method, done)
    if before is not None and after is not None:
        asked = after - before
        row.s3_get, row.s3_get_missing, row.s3_put = asked.get, asked.get_missing, asked.put
        row.chunks_loaded = sum(r.num_cached_tokens for r in done.results[1:]) / chunk_tokens
        if row.chunks_loaded:
            row.usd_per_million_chunks = asked.usd_per_million(row.chunks_loaded)
    return row, done


def phases(episodes: list[Episode], run: EngineRun) -> tuple[list[Phase], dict[str, float]]:
    """Median phases of a new node's requests (their episodes beside their generate calls), and median
    counts: scheduler steps, the idle ones that waited for the tier, lookups, promotion jobs, GETs."""
    per_prompt: list[list[Phase]] = []
    counts: dict[str, list[float]] = {}
    for episode, (g0, g1) in zip(episodes, run.generate_at[1:], strict=False):
        marks = episode.milestones
        if any(m not in marks for m in (milestones.LOOKUP, milestones.INDEX_READ, milestones.LOAD_REPORTED)):
            continue
        per_prompt.append(episode_phases(episode, g0, g1))
        for name in (
            milestones.STEP,
            milestones.IDLE_WAIT,
            milestones.LOOKUP,
            milestones.LOAD_SUBMITTED,
            milestones.GET_RETURNED,
        ):
            counts.setdefault(name, []).append(marks[name].count if name in marks else 0)
    if not per_prompt:
        return [], {}
    merged = [
        Phase(
            per_prompt[0][i].name,
            statistics.median(p[i].start_ms for p in per_prompt),
            statistics.median(p[i].end_ms for p in per_prompt),
            statistics.median(p[i].cpu_ms for p in per_prompt),
        )
        for i in range(min(map(len, per_prompt)))
    ]
    return merged, {name: statistics.median(values) for name, values in counts.items()}


def bench_scheduler(
    store_url: str,
    endpoint: str | None,
    *,
    steps: int = 200,
    chunk_kib: int = 256,
    step_interval_s: float = 0.0,
    loads: bool = True,
    tier_options: dict[str, Any] | None = None,
) -> SchedulerCost:
    """Per-step time of every scheduler-thread call into the tier, with 1000+ chunks in flight.

    `step_interval_s` stands for the model's forward pass between scheduler steps (which releases the
    GIL); 0 runs steps back to back, the worst case, where the tier's own I/O threads compete with the
    scheduler thread for the GIL all the time. Every step stores 32 chunks and, with `loads`, also loads
    32 (requests waiting for loads all the time: the tier then shortens the GIL switch interval).
    """
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from kvstore.connector.harness.standalone import standalone_tier

    chunk = chunk_kib * 1024
    slots = 4096
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-sched-") as tmp:
        options: dict[str, Any] = {
            "store_url": f"{store_url.rstrip('/')}/scheduler-{time.time_ns()}",
            "cache_dir": tmp,
            "cache_bytes": 1 << 34,
        }
        if endpoint:
            options["s3_endpoint"] = endpoint
        node = standalone_tier({**options, **(tier_options or {})}, chunk_bytes=chunk, num_chunks=slots)
        tier = node.tier
        req = ReqContext(req_id="bench")
        tier.on_new_request(req)
        per_step, cpu_per_step, in_flight, max_in_flight = [], [], 0, 0
        job_id, next_block = 0, 0
        stored: list[Any] = []
        for step in range(steps):
            new_keys = [
                make_offload_key(hashlib.sha256(f"b{next_block + i}".encode()).digest(), 0) for i in range(32)
            ]
            next_block += 32
            # One engine step, in the order vLLM calls the tier: the scheduling pass (finished jobs,
            # lookups, new jobs, end of pass), the model (the pause below), then its output (events, stats).
            start, cpu_start = time.perf_counter(), time.thread_time()
            finished = list(tier.get_finished_jobs())
            for key in new_keys:
                tier.lookup(key, req)
            job_id += 1
            ids = np.arange(32, dtype=np.int64) + (step * 32) % (slots // 2)
            tier.submit_store(TransferJob(job_id, new_keys, ids, False, req))
            if stored and loads:
                job_id += 1
                load_keys = stored[-32:]
                tier.submit_load(TransferJob(job_id, load_keys, ids + slots // 2, True, req))
                in_flight += len(load_keys)
            in_flight += 32
            tier.on_schedule_end(None)  # type: ignore[arg-type]  # the standalone scheduler has no context
            elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
            if step_interval_s:
                time.sleep(step_interval_s)
            start, cpu_start = time.perf_counter(), time.thread_time()
            list(tier.take_events())
            tier.get_stats()  # vLLM collects connector stats on every step
            elapsed += time.perf_counter() - start
            cpu += time.thread_time() - cpu_start
            per_step.append(elapsed)
            cpu_per_step.append(cpu)
            in_flight -= 32 * len(finished)
            max_in_flight = max(max_in_flight, in_flight)
            stored.extend(new_keys)
        tier.drain_jobs()
        node.close()
    ordered = sorted(per_step)
    return SchedulerCost(
        step_interval_ms=step_interval_s * 1e3,
        loads_every_step=loads,
        steps=steps,
        max_in_flight_chunks=max_in_flight,
        mean_ms_per_step=statistics.mean(per_step) * 1e3,
        p99_ms_per_step=ordered[int(0.99 * (len(ordered) - 1))] * 1e3,
        cpu_ms_per_step=statistics.mean(cpu_per_step) * 1e3,
    )
