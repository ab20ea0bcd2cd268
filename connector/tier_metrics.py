"""The tier's figures on vLLM's own `/metrics`, through the offloading connector's metric hooks.

vLLM asks each tier for metric definitions once (`build_metric_definitions`) and then, every logging
interval, for the observations since the last call (`get_stats`). The engine keeps cumulative Prometheus
counters; this module turns them into deltas in vLLM's `OffloadingConnectorStats` shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client.metrics import MetricWrapperBase
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

from kvstore.metrics import EngineMetrics

QUERIES = "vllm:kvstore_chunk_queries"
HITS = "vllm:kvstore_chunk_hits"
READ_BYTES = "vllm:kvstore_read_bytes"
WRITE_BYTES = "vllm:kvstore_write_bytes"
READ_SECONDS = "vllm:kvstore_read_seconds"
CHECKSUM_FAILURES = "vllm:kvstore_checksum_failures"
STORES_DROPPED = "vllm:kvstore_stores_dropped"
NVME_USED = "vllm:kvstore_nvme_used_bytes"
NVME_BUDGET = "vllm:kvstore_nvme_budget_bytes"

# vLLM metric name -> (the engine's metric attribute, its sample name); all labelled by tier.
_PER_TIER_COUNTERS = {
    QUERIES: ("queries", "kvstore:chunk_queries_total"),
    HITS: ("hits", "kvstore:chunk_hits_total"),
    READ_BYTES: ("read_bytes", "kvstore:read_bytes_total"),
    WRITE_BYTES: ("write_bytes", "kvstore:write_bytes_total"),
    READ_SECONDS: ("read_seconds", "kvstore:read_seconds_sum"),
    CHECKSUM_FAILURES: ("checksum_failures", "kvstore:checksum_failures_total"),
}
_DROPPED = "kvstore:stores_dropped"


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
    """Turns the engine's cumulative counters into per-step deltas for vLLM.

    vLLM asks on every engine step, on the scheduler thread, so this reads only the metric families it reports
    (never a whole-registry collection, which costs about a millisecond) and the NVMe usage, an index read, at
    most once per `usage_every_s`.
    """

    def __init__(
        self,
        metrics: EngineMetrics,
        *,
        usage_every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._last: dict[tuple[str, str], float] = {}
        self._usage_every = usage_every_s
        self._clock = clock
        self._usage_at = float("-inf")

    def _changes(self, name: str, metric: MetricWrapperBase, sample: str, label: str) -> dict[str, float]:
        """Per label value, how much the cumulative `sample` grew since the previous call."""
        out: dict[str, float] = {}
        for family in metric.collect():
            for found in family.samples:
                if found.name != sample:
                    continue
                key = (name, found.labels[label])
                change = found.value - self._last.get(key, 0.0)
                self._last[key] = found.value
                if change:
                    out[key[1]] = change
        return out

    def collect(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        for name, (attribute, sample) in _PER_TIER_COUNTERS.items():
            metric = getattr(self._metrics, attribute)
            for tier, change in self._changes(name, metric, sample, "tier").items():
                stats.increase_counter(name, change, (tier,))
        dropped = self._metrics.stores_dropped
        for reason, change in self._changes(STORES_DROPPED, dropped, f"{_DROPPED}_total", "reason").items():
            stats.increase_counter(STORES_DROPPED, change, (reason,))
        now = self._clock()
        if now - self._usage_at >= self._usage_every:
            self._usage_at = now
            used = _gauge(self._metrics.nvme_used_bytes)
            budget = _gauge(self._metrics.nvme_budget_bytes)
            if used is not None and budget is not None:
                stats.set_gauge(NVME_USED, used)
                stats.set_gauge(NVME_BUDGET, budget)
        return None if stats.is_empty() else stats


def _gauge(metric: MetricWrapperBase) -> float | None:
    for family in metric.collect():
        for found in family.samples:
            return float(found.value)
    return None
