"""The tier's figures on vLLM's own `/metrics`, through the offloading connector's metric hooks.

vLLM asks each tier for metric definitions once (`build_metric_definitions`) and then, every logging
interval, for the observations since the last call (`get_stats`). The engine keeps cumulative Prometheus
counters; this module turns them into deltas in vLLM's `OffloadingConnectorStats` shape.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

from kvstore.metrics import TIERS, EngineMetrics

QUERIES = "vllm:kvstore_chunk_queries"
HITS = "vllm:kvstore_chunk_hits"
READ_BYTES = "vllm:kvstore_read_bytes"
WRITE_BYTES = "vllm:kvstore_write_bytes"
READ_SECONDS = "vllm:kvstore_read_seconds"
CHECKSUM_FAILURES = "vllm:kvstore_checksum_failures"
STORES_DROPPED = "vllm:kvstore_stores_dropped"
NVME_USED = "vllm:kvstore_nvme_used_bytes"
NVME_BUDGET = "vllm:kvstore_nvme_budget_bytes"

# vLLM metric name -> (kvstore sample name, labelled by tier)
_PER_TIER_COUNTERS = {
    QUERIES: "kvstore:chunk_queries_total",
    HITS: "kvstore:chunk_hits_total",
    READ_BYTES: "kvstore:read_bytes_total",
    WRITE_BYTES: "kvstore:write_bytes_total",
    READ_SECONDS: "kvstore:read_seconds_sum",
    CHECKSUM_FAILURES: "kvstore:checksum_failures_total",
}
_DROP_REASONS = ("queue_full", "store_down", "error")


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    tier = ("tier",)
    return {
        QUERIES: OffloadingCounterMetadata(
            "KVStoreTier chunk lookups answered, by tier (nvme, object).", tier
        ),
        HITS: OffloadingCounterMetadata("KVStoreTier chunk lookups that hit, by tier.", tier),
        READ_BYTES: OffloadingCounterMetadata("KVStoreTier bytes loaded, by tier.", tier),
        WRITE_BYTES: OffloadingCounterMetadata("KVStoreTier bytes written, by tier.", tier),
        READ_SECONDS: OffloadingCounterMetadata("KVStoreTier time spent loading chunks, by tier.", tier),
        CHECKSUM_FAILURES: OffloadingCounterMetadata("KVStoreTier chunks rejected by verification.", tier),
        STORES_DROPPED: OffloadingCounterMetadata(
            "KVStoreTier uploads dropped (store slow or down).", ("reason",)
        ),
        NVME_USED: OffloadingGaugeMetadata("Bytes held by the node's NVMe cache."),
        NVME_BUDGET: OffloadingGaugeMetadata("Byte budget of the node's NVMe cache."),
    }


class TierStats:
    """Turns the engine's cumulative counters into per-interval deltas for vLLM."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics
        self._last: dict[tuple[str, str], float] = {}

    def _delta(self, name: str, sample: str, labels: dict[str, str]) -> float:
        now = self._metrics.registry.get_sample_value(sample, labels) or 0.0
        key = (name, next(iter(labels.values()), ""))
        change = now - self._last.get(key, 0.0)
        self._last[key] = now
        return change

    def collect(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        for name, sample in _PER_TIER_COUNTERS.items():
            for tier in TIERS:
                change = self._delta(name, sample, {"tier": tier})
                if change:
                    stats.increase_counter(name, change, (tier,))
        for reason in _DROP_REASONS:
            change = self._delta(STORES_DROPPED, "kvstore:stores_dropped_total", {"reason": reason})
            if change:
                stats.increase_counter(STORES_DROPPED, change, (reason,))
        registry = self._metrics.registry
        used = registry.get_sample_value("kvstore:nvme_used_bytes")
        budget = registry.get_sample_value("kvstore:nvme_budget_bytes")
        if used is not None and budget is not None:
            stats.set_gauge(NVME_USED, used)
            stats.set_gauge(NVME_BUDGET, budget)
        return None if stats.is_empty() else stats
