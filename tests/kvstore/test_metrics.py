"""`EngineMetrics.snapshot`: the figures the node's counters are made of, read back as plain numbers."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.metrics import EngineMetrics, MetricsSnapshot


class _CountedCollector(Collector):
    """Another metric in the same registry (vLLM's, in vLLM's process), counting how often it is collected."""

    def __init__(self) -> None:
        self.collected = 0

    def collect(self) -> list[GaugeMetricFamily]:
        self.collected += 1
        return [GaugeMetricFamily("other_metric", "not ours", value=1.0)]


def _figures(metrics: EngineMetrics) -> MetricsSnapshot:
    metrics.queries.inc("nvme", 3)
    metrics.hits.inc("object")
    metrics.read_bytes.labels("nvme").inc(100)
    metrics.write_bytes.labels("object").inc(7)
    metrics.checksum_failures.labels("object").inc()
    metrics.stores_dropped.labels("no_room").inc(2)
    metrics.stores_dropped.labels("index_busy").inc()
    metrics.uploads_lost.labels("lost").inc()
    metrics.evictions.inc(5)
    return metrics.snapshot()


def test_snapshot_reads_every_figure() -> None:
    snapshot = _figures(EngineMetrics(CollectorRegistry()))

    nvme, obj = snapshot.per_tier["nvme"], snapshot.per_tier["object"]
    assert (nvme.queries, nvme.hits, nvme.read_bytes, nvme.write_bytes, nvme.checksum_failures) == (
        3,
        0,
        100,
        0,
        0,
    )
    assert (obj.queries, obj.hits, obj.read_bytes, obj.write_bytes, obj.checksum_failures) == (0, 1, 0, 7, 1)
    assert (snapshot.stores_dropped, snapshot.uploads_lost, snapshot.evictions) == (3, 1, 5)


def test_snapshot_leaves_the_registrys_other_metrics_alone() -> None:
    """In vLLM's process the registry holds all of vLLM's metrics: collecting them for every figure cost the
    engine core milliseconds of CPU per snapshot."""
    registry = CollectorRegistry()
    other = _CountedCollector()
    registry.register(other)
    metrics = EngineMetrics(registry)
    other.collected = 0

    _figures(metrics)

    assert other.collected == 0
