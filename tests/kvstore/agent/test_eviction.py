"""The agent's eviction: headroom below the budget is made of uploaded chunks; a chunk still waiting for
upload goes only where the budget itself is exceeded."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from kvstore.agent.eviction import Evictor
from kvstore.cache import NVMeCache
from kvstore.cache.lru import UPLOAD_LOOKAHEAD
from kvstore.chunk import stored_size
from kvstore.metrics import EngineMetrics
from tests.cache_helpers import admit, cached_keys
from tests.helpers import sample

U = stored_size(100)


def k(i: int) -> str:
    return f"llama_abc123def456_r0/abc/de_g0/{i:064x}.bin"


def lost(metrics: EngineMetrics) -> float:
    return sample(metrics, "kvstore:uploads_lost_total", reason="evicted")


def test_headroom_never_costs_a_chunk_its_only_copy(tmp_path: Path) -> None:
    """A full cache of chunks that all wait for upload (a node agent that just started, or a slow store):
    the agent keeps them for its uploads, then makes its headroom of what they uploaded (before: it evicted
    the oldest at once, down to its low watermark, and counted them lost)."""
    metrics = EngineMetrics(CollectorRegistry())
    names = [k(i) for i in range(20)]
    with NVMeCache(tmp_path / "nvme", 20 * U) as cache:
        for i, name in enumerate(names):
            assert admit(cache, name, bytes([i]) * 100, pending_upload=True)
        evictor = Evictor(cache, metrics, low=0.9, high=0.95)
        assert evictor.check() == [], "over the high watermark, but every chunk is its only copy"
        assert cache.finish_uploads(names[5:8]) == []
        assert evictor.check() == names[5:7], "down to the low watermark, uploaded ones only"
        assert lost(metrics) == 0
        assert sample(metrics, "kvstore:nvme_evictions_total") == 2
        assert cache.backlog().chunks == 17


def test_the_budget_holds_even_against_chunks_waiting_for_upload(tmp_path: Path) -> None:
    """A budget that shrank under a cache of chunks waiting for upload (another process with a smaller
    ``cache_bytes``, or a disk that filled up): the oldest go, counted lost, down to the budget itself."""
    metrics = EngineMetrics(CollectorRegistry())
    names = [k(i) for i in range(20)]
    with NVMeCache(tmp_path / "nvme", 20 * U) as cache:
        for i, name in enumerate(names):
            assert admit(cache, name, bytes([i]) * 100, pending_upload=True)
    with NVMeCache(tmp_path / "nvme", 16 * U) as cache:
        assert Evictor(cache, metrics, low=0.5, high=0.95).check() == names[:4]
        assert lost(metrics) == 4
        assert sorted(cached_keys(cache)) == sorted(names[4:])


def test_headroom_is_found_past_the_data_paths_lookahead(tmp_path: Path) -> None:
    """More chunks waiting for upload at the old end of the LRU order than an engine's commit looks past:
    the agent still finds the uploaded chunks behind them (before: it stopped where a commit stops, evicted
    nothing, and the engines' commits then evicted chunks waiting for upload)."""
    metrics = EngineMetrics(CollectorRegistry())
    pending = [k(i) for i in range(UPLOAD_LOOKAHEAD + 44)]
    uploaded = [k(i) for i in range(len(pending), 399)]
    with NVMeCache(tmp_path / "nvme", 400 * U) as cache:
        for name in pending:
            assert admit(cache, name, b"p" * 100, pending_upload=True)
        for name in uploaded:
            assert admit(cache, name, b"u" * 100)
        assert Evictor(cache, metrics, low=0.9, high=0.95).check() == uploaded[:39]
        assert lost(metrics) == 0
