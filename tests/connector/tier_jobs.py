"""Chunks and jobs for the tests that drive KVStoreTier through vLLM's tier API, job by job."""

from __future__ import annotations

import hashlib
import time

import numpy as np
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from kvstore.connector.tier import KVStoreTier

CHUNK = 64 * 1024
REQ = ReqContext(req_id="r1")


def okey(i: int) -> bytes:
    """The offload key of block `i`."""
    return make_offload_key(hashlib.sha256(f"block-{i}".encode()).digest(), 0)


def data(i: int) -> bytes:
    """Block `i`'s bytes: random, so a chunk loaded into the wrong row never passes for the right one."""
    return np.random.default_rng(i).integers(0, 255, CHUNK, dtype=np.uint8).tobytes()


def job(job_id: int, keys: list[bytes], chunk_ids: list[int], promotion: bool) -> TransferJob:
    return TransferJob(job_id, keys, np.array(chunk_ids, dtype=np.int64), promotion, REQ)  # type: ignore[arg-type]


def wait_jobs(tier: KVStoreTier, expected: set[int], timeout: float = 30) -> dict[int, JobResult]:
    """The results of jobs `expected`, each reported exactly once."""
    seen: dict[int, JobResult] = {}
    deadline = time.monotonic() + timeout
    while set(seen) != expected and time.monotonic() < deadline:
        for result in tier.get_finished_jobs():
            assert result.job_id not in seen, "a job was reported twice"
            seen[result.job_id] = result
        time.sleep(0.01)
    assert set(seen) == expected
    return seen
