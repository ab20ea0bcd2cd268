"""The tier's figures on vLLM's own `/metrics`, through the offloading connector's metric hooks.

vLLM asks each tier for metric definitions once (`build_metric_definitions`) and then, on every engine step,
for the observations since the last call (`get_stats`). The engine keeps cumulative Prometheus counters; this
module turns them into deltas in vLLM's `OffloadingConnectorStats` shape, on a thread of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import cast

from prometheus_client.metrics import MetricWrapperBase
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

from kvstore.metrics import EngineMetrics

log = logging.getLogger(__name__)

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
    """Turns the engine's cumulative counters into deltas for vLLM.

    Reads only the metric families it reports (never a whole-registry collection, which costs about a
    millisecond) and the NVMe usage, an index read, at most once per `usage_every_s`; the usage gauges are
    reported when they change.
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
        self._usage: tuple[float, float] | None = None

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
            if used is not None and budget is not None and (used, budget) != self._usage:
                self._usage = (used, budget)
                stats.set_gauge(NVME_USED, used)
                stats.set_gauge(NVME_BUDGET, budget)
        return None if stats.is_empty() else stats


class BackgroundStats:
    """Collects `TierStats` deltas every `interval_s` on its own thread; `take` hands over what is ready.

    vLLM asks for stats on every engine step, on the scheduler thread. Reading the counters there takes the
    metrics' locks, which the tier's busy I/O threads hold too, and every wait for one hands the GIL away;
    taking a ready delta from a deque costs nothing. While the tier is busy the figures arrive at most
    `interval_s` late; `take(now=True)`, for the step where the tier goes idle, also collects what happened
    since, because vLLM may not ask again for a while.
    """

    def __init__(self, stats: TierStats, interval_s: float = 0.5) -> None:
        self._stats = stats
        self._interval = interval_s
        self._lock = threading.Lock()  # one collector at a time: deltas are taken against shared state
        self._ready: deque[OffloadingConnectorStats] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-tier-stats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._collect()

    def _collect(self) -> None:
        try:
            with self._lock:
                delta = self._stats.collect()
        except Exception:  # a metrics bug must not stop the figures for good
            log.exception("could not collect tier stats")
            return
        if delta is not None:
            self._ready.append(delta)

    def take(self, *, now: bool = False) -> OffloadingConnectorStats | None:
        """What was collected since the last call, as one delta (None if nothing changed); with `now`,
        up to this moment."""
        if now:
            self._collect()
        if not self._ready:
            return None
        out = self._ready.popleft()
        while self._ready:
            out = cast(OffloadingConnectorStats, out.aggregate(self._ready.popleft()))
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _gauge(metric: MetricWrapperBase) -> float | None:
    for family in metric.collect():
        for found in family.samples:
            return float(found.value)
    return None
