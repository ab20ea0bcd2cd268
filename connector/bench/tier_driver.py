"""A tier under test, driven the way vLLM's scheduler drives it, outside any engine: the primary region the
tiers copy from and to (like vLLM's shared offload region), our tier and vLLM's `fs` tier opened on it, jobs
submitted and polled once per scheduler step, lookups repeated every step until answered. Timings are wall
seconds and this process's CPU seconds (`Timed`). Shared by `bench tiers` and `bench offered`."""

from __future__ import annotations

import hashlib
import mmap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

from kvstore.agent.supervisor import stop_agent, wait_agent_up
from kvstore.connector.harness.standalone import standalone_spec
from kvstore.connector.tier import KVStoreTier

__all__ = [
    "STEP_S",
    "Primary",
    "StepOutput",
    "Timed",
    "close_tier",
    "end_step",
    "fs_tier",
    "keys_for",
    "make_jobs",
    "our_tier",
    "run_jobs",
    "wait_lookups",
]

STEP_S = 0.0005  # the pause between scheduler steps while a tier works (vLLM's engine loop)


@dataclass(frozen=True)
class StepOutput:
    """What vLLM's scheduler hands its connector at the end of a step, as far as a tier reads it."""

    total_num_scheduled_tokens: int


def end_step(tier: SecondaryTierManager, *, scheduled_tokens: int) -> None:
    """End a scheduler step as vLLM does: its connector's `build_connector_meta(scheduler_output)` calls the
    tiers' `on_schedule_end`. 0 tokens is an idle step (the engine waits on its tiers), where our tier may
    wait for its probe or jobs; more is a step with a forward pass (see `kvstore.connector.idle_step`)."""
    scheduler_output = StepOutput(scheduled_tokens)
    tier.on_schedule_end(None)  # type: ignore[arg-type]  # the standalone scheduler has no context
    del scheduler_output  # the tier reads it from this frame


class Primary:
    """A page-aligned primary region of `rows` chunk rows, like vLLM's shared offload region."""

    def __init__(self, chunk_bytes: int, rows: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.map = mmap.mmap(-1, chunk_bytes * rows)
        # Resident, as vLLM's region is once it has served a while: a first write to each page would cost the
        # copy into it a page fault, which a fresh region pays and a serving one does not.
        np.frombuffer(self.map, dtype=np.uint8)[:: mmap.PAGESIZE] = 0
        self.base = memoryview(self.map)
        self.view = self.base.cast("b", (rows, chunk_bytes))

    def fill(self, rows: int, seed: int) -> None:
        """Rows 0..rows-1: bf16-like values, different in every row."""
        rng = np.random.default_rng(seed)
        target = np.frombuffer(self.map, dtype=np.uint16)
        per_row = self.chunk_bytes // 2
        block = (rng.standard_normal(per_row * 8).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        for row in range(rows):
            start = row * per_row
            target[start : start + per_row] = np.roll(block, row * 7919)[:per_row] ^ np.uint16(row)

    def same(self, a: int, b: int) -> bool:
        size = self.chunk_bytes
        return self.map[a * size : (a + 1) * size] == self.map[b * size : (b + 1) * size]

    def close(self) -> None:
        self.view.release()
        self.base.release()
        self.map.close()


def keys_for(tag: str, n: int) -> list[OffloadKey]:
    return [make_offload_key(hashlib.sha256(f"{tag}-{i}".encode()).digest(), 0) for i in range(n)]


def our_tier(primary: Primary, root: Path, store_url: str, **options: Any) -> KVStoreTier:
    settings: dict[str, Any] = {
        "store_url": store_url,
        "cache_dir": str(root / "nvme"),
        "cache_bytes": 1 << 40,
        "pin_sync_s": 0,
    }
    tier = KVStoreTier(
        offloading_spec=standalone_spec(),
        primary_kv_view=primary.view,
        tier_type="KVStoreTier",
        **{**settings, **options},
    )
    # On a node the agent runs long before the first store: its start must not land in a measurement.
    cache_dir = tier.engine.cache.directory
    if options.get("agent", "auto") == "auto" and not wait_agent_up(cache_dir, timeout_s=60):
        raise RuntimeError(f"the node agent on {cache_dir} did not start within 60 s")
    return tier


def fs_tier(primary: Primary, root: Path) -> FileSystemTierManager:
    return FileSystemTierManager(standalone_spec(), primary.view, "fs", root_dir=str(root / "fs"))


def close_tier(tier: SecondaryTierManager) -> None:
    tier.drain_jobs()
    tier.shutdown()
    if isinstance(tier, KVStoreTier):  # the node agent it started goes too (its directory is removed next)
        stop_agent(tier.engine.cache.directory)


@dataclass(frozen=True)
class Timed:
    seconds: float  # wall time
    cpu_s: float  # CPU time of this process (every thread), over the same span
    cpu_by_thread: dict[str, float] = field(default_factory=dict)  # ... by thread role (`thread_cpu`)


def run_jobs(tier: SecondaryTierManager, jobs: Sequence[TransferJob], *, load: bool) -> Timed:
    """Submit every job, then poll once per step until all have reported: wall seconds from the first submit
    to the last report, and this process's CPU seconds over that span."""
    cpu = time.process_time()
    start = time.perf_counter()
    for job in jobs:
        (tier.submit_load if load else tier.submit_store)(job)
    waiting = {job.job_id for job in jobs}
    failed: list[int] = []
    while waiting:
        end_step(tier, scheduled_tokens=0 if load else 1)  # vLLM waits on loads; it stores while it serves
        for result in tier.get_finished_jobs():
            waiting.discard(result.job_id)
            if not result.success:
                failed.append(result.job_id)
        if waiting:
            time.sleep(STEP_S)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    if failed:
        raise RuntimeError(f"{type(tier).__name__}: {len(failed)} of {len(jobs)} jobs failed")
    return Timed(elapsed, cpu)


def make_jobs(
    keys: Sequence[OffloadKey], rows: Sequence[int], per_job: int, first_id: int
) -> list[TransferJob]:
    req = ReqContext(req_id="bench")
    return [
        TransferJob(
            first_id + n,
            list(keys[i : i + per_job]),
            np.asarray(rows[i : i + per_job], dtype=np.int64),
            False,
            req,
        )
        for n, i in enumerate(range(0, len(keys), per_job))
    ]


def wait_lookups(tier: SecondaryTierManager, keys: Sequence[OffloadKey], timeout: float = 120.0) -> None:
    """Look every key up, step by step, until all are HITs (what vLLM does before it submits loads)."""
    req = ReqContext(req_id="bench-lookup")
    tier.on_new_request(req)
    pending = list(keys)
    deadline = time.monotonic() + timeout
    while pending:
        results = [tier.lookup(key, req) for key in pending]
        if LookupResult.MISS in results:
            raise RuntimeError(f"{type(tier).__name__}: a stored chunk is a miss")
        pending = [k for k, r in zip(pending, results, strict=True) if r is not LookupResult.HIT]
        end_step(tier, scheduled_tokens=0)
        if pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{type(tier).__name__}: lookups did not settle")
            time.sleep(STEP_S)
