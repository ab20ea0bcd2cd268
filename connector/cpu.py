"""`CPUTieringSpec`: vLLM's `TieringOffloadingSpec` on the CPU backend.

Upstream's tiering spec builds its scheduler side (CPU primary tier + secondary tiers) on
any platform, but its worker copies between the GPU KV cache and the primary tier with CUDA
streams and refuses non-CUDA/XPU platforms in ``get_worker()``. On vLLM's CPU backend the
"device" KV cache already lives in host memory, so the worker only has to copy bytes between
two host buffers. This spec swaps in such a worker and changes nothing else, so every
secondary tier (vLLM's ``fs``, ours) works unchanged.

Select it inside ``kv_connector_extra_config`` of an ``OffloadingConnector`` config::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {
         "spec_name": "CPUTieringSpec", "spec_module_path": "kvstore.connector.cpu",
         "cpu_bytes_to_use": 268435456,
         "secondary_tiers": [{"type": "fs", "root_dir": "/path"}]}}

Contract of the worker (the same as upstream's GPU worker, but synchronous):
  * a store copies, for every KV-cache group, ``group_sizes[g]`` device blocks into the
    primary-tier chunks of the destination spec; a chunk holds ``blocks_per_chunk`` device
    blocks per tensor, and the first chunk of a group is entered at sub-block
    ``block_indices[g] % blocks_per_chunk`` (the request may resume mid-chunk); a load is
    the mirror image;
  * chunk rows are laid out as upstream's ``SharedOffloadRegion`` worker views, so the
    scheduler-side ``primary_kv_view[chunk_id]`` that secondary tiers read and write holds
    exactly the bytes the GPU worker would have put there (chunks are interchangeable
    between CPU and GPU instances with the same layout);
  * copies run on the calling thread inside ``submit_*``: vLLM submits stores at the start
    of the step after the KV was written and waits for loads before scheduling their
    request, and the CPU forward pass is synchronous, so no extra ordering is needed;
    results are reported once by ``get_finished()``.
The canonical (parallelism-agnostic) host layout is not supported on CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from typing_extensions import override
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["CPUCopyWorker", "CPUTieringSpec"]


@dataclass(frozen=True)
class _TensorPair:
    """One KV tensor of the engine and its primary-tier view.

    ``device`` is ``(num_blocks, page_bytes)`` int8; ``host`` is the same bytes seen as
    ``(num_chunks, blocks_per_chunk, page_bytes)`` over the shared region's strided rows.
    """

    device: torch.Tensor
    host: torch.Tensor


def _as_block_bytes(tensor: torch.Tensor, page_size_bytes: int) -> torch.Tensor:
    """View a KV tensor whose leading dim is the block as ``(num_blocks, page_bytes)`` int8."""
    t = tensor if tensor.dtype == torch.int8 else tensor.view(torch.int8)
    if t.dim() == 2 and t.shape[1] == page_size_bytes:
        return t
    return t.reshape(t.shape[0], -1)[:, :page_size_bytes]


class CPUCopyWorker(OffloadingWorker):
    """Copies blocks between vLLM's CPU KV cache and the shared primary-tier region."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        region: SharedOffloadRegion,
    ) -> None:
        self._region: SharedOffloadRegion | None = region
        self._blocks_per_chunk = blocks_per_chunk
        self._group_refs: list[list[CanonicalKVCacheRef]] = kv_caches.group_data_refs
        self._pairs: list[_TensorPair] = []
        for kv in kv_caches.tensors:
            device = _as_block_bytes(kv.tensor, kv.page_size_bytes)
            if device.device.type != "cpu":
                raise RuntimeError(f"CPUCopyWorker needs CPU KV caches, got {device.device}")
            rows = region.create_next_worker_view(kv.page_size_bytes * blocks_per_chunk)
            host = rows.view(rows.shape[0], blocks_per_chunk, kv.page_size_bytes)
            self._pairs.append(_TensorPair(device=device, host=host))
        self._finished: list[TransferResult] = []

    def _positions(
        self, gpu: GPULoadStoreSpec, chunks: BlockIDsLoadStoreSpec
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]:
        """Map each device block to its (chunk, sub-block) slot; per-group [start, end)."""
        bpc = self._blocks_per_chunk
        device_ids = np.asarray(gpu.block_ids, dtype=np.int64)
        chunk_ids = np.asarray(chunks.block_ids, dtype=np.int64)
        rows: list[np.ndarray] = []
        subs: list[np.ndarray] = []
        spans: list[tuple[int, int]] = []
        dev_off = chunk_off = 0
        for size, first_index in zip(gpu.group_sizes, gpu.block_indices, strict=True):
            spans.append((dev_off, dev_off + size))
            if size == 0:
                continue
            flat = (first_index % bpc) + np.arange(size, dtype=np.int64)
            n_chunks = int(flat[-1] // bpc) + 1
            if chunk_off + n_chunks > len(chunk_ids):
                raise ValueError("destination spec has fewer chunks than the device blocks need")
            rows.append(chunk_ids[chunk_off + flat // bpc])
            subs.append(flat % bpc)
            dev_off += size
            chunk_off += n_chunks
        if dev_off != len(device_ids) or chunk_off != len(chunk_ids):
            raise ValueError("block and chunk counts do not match the group sizes")
        empty = np.empty(0, dtype=np.int64)
        return (
            device_ids,
            np.concatenate(rows) if rows else empty,
            np.concatenate(subs) if subs else empty,
            spans,
        )

    def _transfer(self, job_id: int, gpu: GPULoadStoreSpec, chunks: LoadStoreSpec, store: bool) -> bool:
        assert isinstance(chunks, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        device_ids, rows, subs, spans = self._positions(gpu, chunks)
        num_bytes = 0
        for g, (lo, hi) in enumerate(spans):
            if lo == hi:
                continue
            dev_idx = torch.from_numpy(device_ids[lo:hi])
            row_idx = torch.from_numpy(rows[lo:hi])
            sub_idx = torch.from_numpy(subs[lo:hi])
            for ref in self._group_refs[g]:
                pair = self._pairs[ref.tensor_idx]
                n = ref.page_size_bytes
                if store:
                    pair.host[row_idx, sub_idx, :n] = pair.device[dev_idx, :n]
                else:
                    pair.device[dev_idx, :n] = pair.host[row_idx, sub_idx, :n]
                num_bytes += (hi - lo) * n
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=num_bytes,
                transfer_time=time.perf_counter() - start,
            )
        )
        return True

    @override
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Copy device blocks into primary-tier chunks (done when this returns)."""
        return self._transfer(job_id, src_spec, dst_spec, store=True)

    @override
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Copy primary-tier chunks into device blocks (done when this returns)."""
        return self._transfer(job_id, dst_spec, src_spec, store=False)

    @override
    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    @override
    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: every submitted copy has already completed."""
        return

    @override
    def shutdown(self) -> None:
        self._pairs.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class CPUTieringSpec(TieringOffloadingSpec):
    """`TieringOffloadingSpec` whose worker runs on vLLM's CPU backend.

    The scheduler side (primary tier, secondary tiers, metrics, events) is inherited
    unchanged; only the worker differs.
    """

    @override
    def create_worker(self, kv_caches: CanonicalKVCaches) -> CPUCopyWorker:  # type: ignore[override]
        if self.config.canonical_layout:
            raise RuntimeError("canonical_layout is not supported by CPUTieringSpec")
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self.config.engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return CPUCopyWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            region.cleanup()
            raise

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """Build the CPU worker once; unlike upstream, no CUDA/XPU platform check."""
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)  # type: ignore[assignment]
        assert self._worker is not None
        return self._worker
