"""`kvstore bench vllm`: what the tier buys inside a real vLLM engine, against vLLM's own `fs` tier.

TTFT of long prompts, in one run, when the prefix is
  - recomputed (no offloading),
  - loaded by vLLM's built-in `fs` tier (fresh engine, same directory),
  - loaded by KVStoreTier from the node's NVMe cache (fresh engine, same cache),
  - loaded by KVStoreTier from the object store alone (fresh engine, empty cache: a new node).
Each engine first runs a short unrelated warm-up prompt, so TTFT excludes first-request effects; TTFT is
the time of a `max_tokens=1` request, the median over the prompts.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.agent.supervisor import stop_agent
from kvstore.agent.uploads import wait_uploaded
from kvstore.cache import NVMeCache
from kvstore.connector.configs import cpu_tiering_config
from kvstore.connector.harness.engine_runner import run_engine
from kvstore.connector.harness.tiny_model import build_tiny_model, sample_text


@dataclass
class TTFTRow:
    method: str
    ttft_s: float
    cached_tokens: int
    speedup_vs_recompute: float = 0.0
    vs_fs_tier: float = 0.0


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
    rows: list[TTFTRow] = field(default_factory=list)
    scheduler: list[SchedulerCost] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _fill(model: Path, prompts: list[str], config: dict[str, Any], env: dict[str, str]) -> None:
    # A few decode steps after each prefill: offloads are submitted on the steps that follow.
    run_engine(model, prompts, kv_transfer_config=config, env=env, max_tokens=8, settle_s=2.0)


def _ttft(
    model: Path, prompts: list[str], config: dict[str, Any] | None, env: dict[str, str]
) -> tuple[float, int]:
    run = run_engine(
        model, [sample_text(50, seed=999), *prompts], kv_transfer_config=config, env=env, max_tokens=1
    )
    cached = [r.num_cached_tokens for r in run.results[1:]]
    return statistics.median(run.generate_s[1:]), min(cached)


def bench_ttft(
    store_url: str,
    endpoint: str | None,
    credentials: dict[str, str],
    *,
    words: int = 5600,
    prompts: int = 3,
    workdir: Path | None = None,
    progress: Any = print,
) -> VLLMReport:
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-vllm-", dir=workdir))
    try:
        model = build_tiny_model(root / "tiny-llama")
        texts = [sample_text(words, seed=100 + i) for i in range(prompts)]
        ours = {
            "type": "KVStoreTier",
            "module_path": "kvstore.connector.tier",
            "store_url": f"{store_url.rstrip('/')}/ttft",
            "cache_dir": str(root / "nvme-a"),
        }
        if endpoint:
            ours["s3_endpoint"] = endpoint
        fs = {"type": "fs", "root_dir": str(root / "fs")}

        progress("recompute (no offloading)")
        recompute, _ = _ttft(model, texts, None, credentials)
        progress("vLLM fs tier: fill, then a fresh engine")
        _fill(model, texts, cpu_tiering_config(fs), credentials)
        fs_ttft, fs_cached = _ttft(model, texts, cpu_tiering_config(fs), credentials)
        progress("KVStoreTier: fill, then a fresh engine on the same NVMe cache")
        _fill(model, texts, cpu_tiering_config(ours), credentials)
        nvme_ttft, nvme_cached = _ttft(model, texts, cpu_tiering_config(ours), credentials)
        with NVMeCache(root / "nvme-a", 1 << 40) as cache:  # the node agent the tier started uploads them
            wait_uploaded(cache, 600)
        progress("KVStoreTier: a fresh node (empty NVMe cache, same bucket)")
        fresh = {**ours, "cache_dir": str(root / "nvme-b")}
        object_ttft, object_cached = _ttft(model, texts, cpu_tiering_config(fresh), credentials)

        tokens = run_engine(model, [texts[0]], max_tokens=1).results[0].prompt_len
        report = VLLMReport(prompt_tokens=tokens, prompts=prompts)
        for method, ttft, cached in (
            ("recompute", recompute, 0),
            ("vLLM fs tier", fs_ttft, fs_cached),
            ("KVStoreTier, NVMe hit", nvme_ttft, nvme_cached),
            ("KVStoreTier, object store only", object_ttft, object_cached),
        ):
            report.rows.append(TTFTRow(method, ttft, cached, recompute / ttft, ttft / fs_ttft))
        return report
    finally:
        for node in ("nvme-a", "nvme-b"):  # the node agents the tiers started outlive their engines
            stop_agent(root / node)
        shutil.rmtree(root, ignore_errors=True)


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
