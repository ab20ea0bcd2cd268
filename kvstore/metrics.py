"""Prometheus metrics of the data path, named in vLLM's style (`kvstore:` prefix, per-tier labels).

Tiers: `nvme` (the node's cache), `object` (the local region's store). Metrics live in a registry chosen by
the caller, so a test or a second engine in one process can have its own; `snapshot()` reads them back as
plain numbers, which is what the vLLM tier forwards through vLLM's metric hooks.

With several regions (`kvstore.stores.regions`), `kvstore:region_hits`, `kvstore:region_copies` and
`kvstore:region_errors`, labelled by region name, say which region served a load, what was copied into the
local region, and which remote failed or timed out.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Metric
from prometheus_client.core import CounterMetricFamily

from kvstore.errors import KVStoreError

TIERS = ("nvme", "object")
# index_busy: the index could not commit in time (another process holds its write lock: a hung agent).
DROP_REASONS = ("no_room", "write_error", "store_down", "error", "index_busy")
LOST_UPLOAD_REASONS = ("evicted", "discarded", "fsck", "lost")
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EngineMetrics:
    """The counters, histograms and gauges of one `TieredStore` (or several sharing a registry)."""

    _by_registry: dict[int, EngineMetrics] = {}  # noqa: RUF012 - one set of metric objects per registry

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # Lookups are the tier's hottest path (the scheduler asks every step): counted without locks.
        self.queries = ThreadCounter(
            "kvstore:chunk_queries", "Chunk lookups answered by a tier", "tier", registry=registry
        )
        self.hits = ThreadCounter(
            "kvstore:chunk_hits", "Chunk lookups that found the chunk in a tier", "tier", registry=registry
        )
        self.read_bytes = Counter(
            "kvstore:read_bytes", "Chunk bytes loaded from a tier", ["tier"], registry=registry
        )
        self.write_bytes = Counter(
            "kvstore:write_bytes", "Chunk bytes written to a tier", ["tier"], registry=registry
        )
        self.read_seconds = Histogram(
            "kvstore:read_seconds",
            "Latency of one chunk load",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.write_seconds = Histogram(
            "kvstore:write_seconds",
            "Latency of one chunk write",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.load_failures = Counter(
            "kvstore:load_failures", "Chunk loads that found nothing usable", ["tier"], registry=registry
        )
        self.checksum_failures = Counter(
            "kvstore:checksum_failures",
            "Chunks rejected because their bytes failed verification",
            ["tier"],
            registry=registry,
        )
        self.unreadable = Counter(
            "kvstore:unreadable_chunks",
            "Chunks this reader cannot use (another version, codec or buffer size): misses, left alone",
            ["tier"],
            registry=registry,
        )
        self.write_failures = Counter(
            "kvstore:write_failures",
            "Chunk writes that failed (disk full, I/O error)",
            ["tier"],
            registry=registry,
        )
        self.stores_dropped = Counter(
            "kvstore:stores_dropped",
            "Chunks a store job could not keep: no room (the rest is pinned), a write error, or no store",
            ["reason"],
            registry=registry,
        )
        self.tail_probes_on_node = Counter(
            "kvstore:tail_probes_on_node",
            "Chunks of a request's short unknown tail asked of this node only (the bucket was not asked)",
            registry=registry,
        )
        self.tail_lookups_not_waited = Counter(
            "kvstore:tail_lookups_not_waited",
            "Lookups of a request's short unknown tail after a held beginning, answered as misses at once "
            "while the probe asks about them in the background (`no_wait_tail_tokens`)",
            registry=registry,
        )
        self.store_errors = Counter(
            "kvstore:object_store_errors", "Object store operations that failed", ["op"], registry=registry
        )
        self.evictions = Counter(
            "kvstore:nvme_evictions", "Chunks evicted from the NVMe cache", registry=registry
        )
        self.uploads_lost = Counter(
            "kvstore:uploads_lost",
            "Chunks that left the NVMe cache before their upload (evicted, discarded as corrupt, lost)",
            ["reason"],
            registry=registry,
        )
        self.upload_retries = Counter(
            "kvstore:upload_retries", "Uploads deferred after a failed PUT (retried later)", registry=registry
        )
        self.admissions_skipped = Counter(
            "kvstore:admissions_skipped",
            "Object hits not written to NVMe: the cache evicts chunks used under a minute ago",
            registry=registry,
        )
        self.upload_held_seconds = Counter(
            "kvstore:upload_held_seconds",
            "Seconds uploads waited because the engines left no CPU core idle (`upload_hold_s`)",
            registry=registry,
        )
        self.upload_backlog_chunks = Gauge(
            "kvstore:upload_backlog_chunks",
            "Chunks on NVMe waiting for upload (node-wide)",
            registry=registry,
        )
        self.upload_backlog_bytes = Gauge(
            "kvstore:upload_backlog_bytes", "Bytes on NVMe waiting for upload (node-wide)", registry=registry
        )
        self.upload_backlog_age = Gauge(
            "kvstore:upload_backlog_oldest_seconds",
            "Age of the oldest chunk waiting for upload (0 when none)",
            registry=registry,
        )
        self.prefetch_bytes = Gauge(
            "kvstore:prefetch_bytes",
            "Bytes fetched by probes and held for the loads that follow",
            registry=registry,
        )
        self.nvme_direct_io = Gauge(
            "kvstore:nvme_direct_io",
            "1 when NVMe chunk files bypass the page cache (O_DIRECT), 0 when the filesystem refuses it",
            registry=registry,
        )
        self.nvme_used_bytes = Gauge(
            "kvstore:nvme_used_bytes", "Bytes held by the NVMe cache", registry=registry
        )
        self.nvme_budget_bytes = Gauge(
            "kvstore:nvme_budget_bytes", "Byte budget of the NVMe cache", registry=registry
        )
        self.object_store_up = Gauge(
            "kvstore:object_store_up", "1 while the object store answers, else 0", registry=registry
        )
        self.object_store_up.set(1)
        self.agent_up = Gauge(
            "kvstore:agent_up",
            "1 while the node agent runs (uploads, eviction, access records), 0 when none does or it hangs",
            registry=registry,
        )
        self.agent_hints_dropped = Counter(
            "kvstore:agent_hints_dropped",
            "Hints (chunks stored, chunks used, counters) an engine could not hand to the node agent",
            registry=registry,
        )
        self.agent_hints_rejected = Counter(
            "kvstore:agent_hints_rejected",
            "Hint datagrams the node agent refused in whole or in part (not a hint, a key the index cannot "
            "hold, an unknown counter or an increment out of bounds)",
            registry=registry,
        )
        # Multi-region (see kvstore.stores.regions): label `region` is the region's configured name.
        self.region_hits = Counter(
            "kvstore:region_hits",
            "Object-store chunk loads served, by the region that had them",
            ["region"],
            registry=registry,
        )
        self.region_copies = Counter(
            "kvstore:region_copies",
            "Chunks copied into the local region after a remote hit, by source region",
            ["region"],
            registry=registry,
        )
        self.region_errors = Counter(
            "kvstore:region_errors",
            "Remote-region reads that failed or passed their deadline (the region is then skipped a while)",
            ["region"],
            registry=registry,
        )

        # Every series exists from the start at 0: a dashboard (or a test) tells "none" from "not exported".
        for tier in TIERS:
            for per_tier in (
                self.read_bytes,
                self.write_bytes,
                self.load_failures,
                self.checksum_failures,
                self.unreadable,
                self.write_failures,
            ):
                per_tier.labels(tier)
        for reason in DROP_REASONS:
            self.stores_dropped.labels(reason)
        for reason in LOST_UPLOAD_REASONS:
            self.uploads_lost.labels(reason)
        for op in ("get", "put", "exists"):
            self.store_errors.labels(op)

    @classmethod
    def for_registry(cls, registry: CollectorRegistry | None = None) -> EngineMetrics:
        registry = registry if registry is not None else REGISTRY
        found = cls._by_registry.get(id(registry))
        if found is None:
            found = cls._by_registry[id(registry)] = cls(registry)
        return found

    def track_nvme_usage(self, usage: Callable[[], tuple[int, int]]) -> None:
        """Read NVMe usage lazily at scrape time (it is shared by every process on the node)."""
        self.nvme_used_bytes.set_function(_at_scrape(usage, 0))
        self.nvme_budget_bytes.set_function(_at_scrape(usage, 1))

    def track_backlog(self, backlog: Callable[[], tuple[int, int, float]]) -> None:
        """Read the upload backlog (chunks, bytes, oldest age in seconds) lazily at scrape time."""
        self.upload_backlog_chunks.set_function(_at_scrape(backlog, 0))
        self.upload_backlog_bytes.set_function(_at_scrape(backlog, 1))
        self.upload_backlog_age.set_function(_at_scrape(backlog, 2))

    def snapshot(self) -> MetricsSnapshot:
        # Read from these metrics alone: the registry may be vLLM's whole default one, and asking it for a
        # sample collects all of it (every histogram, every gauge's function) for each figure: 7 ms of the
        # engine core's CPU per snapshot in `bench multiturn`, every 2 s (measured 2026-12-06).
        mine = (
            self.queries,
            self.hits,
            self.read_bytes,
            self.write_bytes,
            self.checksum_failures,
            self.stores_dropped,
            self.uploads_lost,
            self.evictions,
        )
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for metric in mine
            for family in metric.collect()
            for sample in family.samples
        }

        def value(name: str, **labels: str) -> float:
            return samples.get((name, tuple(sorted(labels.items()))), 0.0)

        per_tier = {
            tier: TierFigures(
                queries=value("kvstore:chunk_queries_total", tier=tier),
                hits=value("kvstore:chunk_hits_total", tier=tier),
                read_bytes=value("kvstore:read_bytes_total", tier=tier),
                write_bytes=value("kvstore:write_bytes_total", tier=tier),
                checksum_failures=value("kvstore:checksum_failures_total", tier=tier),
            )
            for tier in TIERS
        }
        dropped = sum(value("kvstore:stores_dropped_total", reason=r) for r in DROP_REASONS)
        lost = sum(value("kvstore:uploads_lost_total", reason=r) for r in LOST_UPLOAD_REASONS)
        return MetricsSnapshot(
            per_tier=per_tier,
            stores_dropped=dropped,
            uploads_lost=lost,
            evictions=value("kvstore:nvme_evictions_total"),
        )


class ThreadCounter:
    """A counter with one label, incremented without a lock: every thread counts into a dict of its own, and
    a scrape sums them. A Prometheus counter takes a lock per increment, which costs more than the lookup it
    counts and, inside vLLM, can hand the scheduler thread's GIL away."""

    def __init__(self, name: str, documentation: str, label: str, *, registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._label = label
        self._local = threading.local()
        self._cells: list[dict[str, int]] = []
        self._cells_lock = threading.Lock()  # only when a thread counts for the first time
        registry.register(self)

    def _cell(self) -> dict[str, int]:
        cell: dict[str, int] | None = getattr(self._local, "cell", None)
        if cell is None:
            cell = self._local.cell = {}
            with self._cells_lock:
                self._cells.append(cell)
        return cell

    def inc(self, value: str, amount: int = 1) -> None:
        cell = self._cell()
        cell[value] = cell.get(value, 0) + amount

    def labels(self, value: str) -> _Bound:
        """Prometheus's API: `labels(v).inc()`; binding first saves nothing here."""
        return _Bound(self, value)

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self._name, self._documentation, labels=[self._label])]

    def collect(self) -> list[Metric]:
        totals: dict[str, int] = {}
        with self._cells_lock:
            cells = list(self._cells)
        for cell in cells:
            for value, count in list(cell.items()):
                totals[value] = totals.get(value, 0) + count
        family = CounterMetricFamily(self._name, self._documentation, labels=[self._label])
        for tier in TIERS:
            totals.setdefault(tier, 0)  # every series exists from the start
        for value, count in sorted(totals.items()):
            family.add_metric([value], float(count))
        return [family]


@dataclass(frozen=True)
class _Bound:
    counter: ThreadCounter
    value: str

    def inc(self, amount: int = 1) -> None:
        self.counter.inc(self.value, amount)


def _at_scrape(read: Callable[[], tuple[float, ...]], field: int) -> Callable[[], float]:
    """A gauge callback that never fails a scrape: NaN once its source is gone (a closed cache)."""

    def value() -> float:
        try:
            return float(read()[field])
        except KVStoreError:
            return math.nan

    return value


@dataclass(frozen=True)
class TierFigures:
    queries: float
    hits: float
    read_bytes: float
    write_bytes: float
    checksum_failures: float


@dataclass(frozen=True)
class MetricsSnapshot:
    per_tier: dict[str, TierFigures]
    stores_dropped: float
    uploads_lost: float = 0.0
    evictions: float = 0.0
