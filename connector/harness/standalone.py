"""Build a `KVStoreTier` outside an engine, with vLLM's own config classes and a page-aligned primary buffer.

Used by the contract tests and by the scheduler-overhead benchmark: the tier sees exactly what vLLM's
`TieringOffloadingSpec` would hand it, minus the GPU/CPU KV cache that only the worker side needs.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import OffloadingSpec
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvstore.agent.supervisor import stop_agent
from kvstore.connector.tier import KVStoreTier


class StandaloneSpec(OffloadingSpec):
    """An OffloadingSpec with a real OffloadingConfig and no manager or worker of its own."""

    def get_manager(self) -> Any:
        raise NotImplementedError("the standalone spec only configures a tier")

    def get_worker(self, kv_caches: Any) -> Any:
        raise NotImplementedError("the standalone spec only configures a tier")


def standalone_spec(
    model: str = "standalone/model", *, kv_events: bool = False, layers: int = 4
) -> StandaloneSpec:
    config = OffloadingConfig(
        groups=(
            OffloadingGroupConfig(128, tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers)), 0),
        ),
        worker_kv_bytes_per_block=1,
        enable_kv_cache_events=kv_events,
        extra_config={},
        engine_id="standalone",
        model=OffloadingModelConfig(name=model, dtype="torch.bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=128, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    return StandaloneSpec(config)


@dataclass
class StandaloneTier:
    tier: KVStoreTier
    primary: mmap.mmap
    base: memoryview
    view: memoryview
    chunk_bytes: int

    def slot(self, chunk_id: int) -> bytearray:
        """A copy of one primary row (copies keep no export alive)."""
        start = chunk_id * self.chunk_bytes
        return bytearray(self.primary[start : start + self.chunk_bytes])

    def fill(self, chunk_id: int, data: bytes) -> None:
        start = chunk_id * self.chunk_bytes
        self.primary[start : start + self.chunk_bytes] = data

    def close(self) -> None:
        self.tier.shutdown()
        # The node agent the tier started (option `agent: auto`) outlives it by design; a harness that is
        # done with the cache directory stops it.
        stop_agent(self.tier.engine.cache.directory)
        self.view.release()
        self.base.release()
        self.primary.close()


def standalone_tier(
    options: dict[str, Any], *, chunk_bytes: int = 256 * 1024, num_chunks: int = 64, kv_events: bool = False
) -> StandaloneTier:
    """A tier over an anonymous page-aligned primary region of `num_chunks` rows of `chunk_bytes`."""
    primary = mmap.mmap(-1, chunk_bytes * num_chunks)
    base = memoryview(primary)
    view = base.cast("b", (num_chunks, chunk_bytes))
    tier = KVStoreTier(
        offloading_spec=standalone_spec(kv_events=kv_events),
        primary_kv_view=view,
        tier_type="KVStoreTier",
        **options,
    )
    return StandaloneTier(tier, primary, base, view, chunk_bytes)
