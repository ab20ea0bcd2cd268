"""One node's figures in one dict: tier hit rates (node-wide: every process on the node publishes its own
into the cache index, see `kvstore.engine.node_counters`), NVMe usage, upload backlog, the node agent, bucket
size, pins, last GC, and with several regions, each region's reachability and traffic.

`node_stats` backs `GET /v1/stats` and `kvstore stats`. Every section is computed independently: a store that
is down turns its sections into `{"error": ...}` instead of failing the whole answer. Counting the bucket
streams a listing of every object (memory stays bounded, time does not): pass `scan_bucket=False` on huge
buckets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from kvstore.cache import NVMeCache
from kvstore.engine.node_counters import FIELDS, counter_name
from kvstore.errors import KVStoreError
from kvstore.gc import list_reports
from kvstore.layout import is_chunk_key
from kvstore.metrics import TIERS
from kvstore.pins import list_pins
from kvstore.stores import ObjectStore, RegionalStore

__all__ = ["BucketSize", "NodeParts", "bucket_size", "local_stats", "node_stats", "store_stats"]


class NodeParts(Protocol):
    """What the figures need: the store and the cache (a `runtime.Node`, or a tool's pair without an engine,
    whose threads a read-only command has no use for)."""

    @property
    def store(self) -> ObjectStore: ...

    @property
    def cache(self) -> NVMeCache: ...


@dataclass(frozen=True)
class BucketSize:
    """The store's chunk objects (`.bin` outside `_meta/`): how many, how many bytes."""

    chunk_objects: int
    chunk_bytes: int


def bucket_size(store: ObjectStore) -> BucketSize:
    """Count the store's chunk objects and their bytes with one streamed listing."""
    objects = 0
    size = 0
    for info in store.list():
        if is_chunk_key(info.key):
            objects += 1
            size += info.size
    return BucketSize(chunk_objects=objects, chunk_bytes=size)


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _tiers(cache: NVMeCache) -> dict[str, Any]:
    """The node's tier figures: what every process on the node (vLLM tiers, the admin service) published."""
    try:
        counters = cache.counters()
    except KVStoreError as exc:
        return {"tiers": {"error": str(exc)}, "stores_dropped": None}
    out: dict[str, Any] = {}
    for tier in TIERS:
        fig = {field: counters.get(counter_name(tier, field), 0) for field in FIELDS}
        out[tier] = {**fig, "hit_rate": _ratio(fig["hits"], fig["queries"])}
    return {"tiers": out, "stores_dropped": counters.get("stores_dropped", 0)}


def _nvme(cache: NVMeCache) -> dict[str, Any]:
    try:
        usage = cache.usage()
    except KVStoreError as exc:
        return {"directory": str(cache.directory), "error": str(exc)}
    return {
        "directory": str(cache.directory),
        "used_bytes": usage.used_bytes,
        "budget_bytes": usage.budget_bytes,
        "used_fraction": _ratio(usage.used_bytes, usage.budget_bytes),
        "entries": usage.entries,
        "pinned_entries": usage.pinned_entries,
    }


def _regions(store: RegionalStore) -> list[dict[str, Any]]:
    """Per region: where it is, whether it answers, and what this node read from it and copied home."""
    registry = store.metrics.registry

    def count(name: str, region: str) -> int:
        return int(registry.get_sample_value(f"kvstore:{name}_total", {"region": region}) or 0)

    out: list[dict[str, Any]] = []
    for name, region_store in store.region_stores():
        local = name == store.local_name
        entry: dict[str, Any] = {"name": name, "url": region_store.url, "local": local}
        try:
            region_store.check()
            entry["reachable"] = True
        except KVStoreError as exc:
            entry.update(reachable=False, error=str(exc))
        if not local:
            entry["cooling_down"] = not store.remote_available(name)
        entry.update(hits=count("region_hits", name), errors=count("region_errors", name))
        if not local:
            entry["copied_home"] = count("region_copies", name)
        out.append(entry)
    return out


def node_stats(node: NodeParts, *, scan_bucket: bool = True) -> dict[str, Any]:
    """A JSON-ready summary of the node. `scan_bucket=False` skips the (full) bucket listing."""
    return {**local_stats(node), **store_stats(node, scan_bucket=scan_bucket)}


def local_stats(node: NodeParts) -> dict[str, Any]:
    """The sections that need no object store: tiers, NVMe usage, the upload backlog. Never blocks on the
    network (the admin service answers these live and the rest from `store_stats` run in the background)."""
    out: dict[str, Any] = _tiers(node.cache)
    out["nvme"] = _nvme(node.cache)
    backlog = node.cache.backlog()
    out["upload_backlog"] = {"chunks": backlog.chunks, "bytes": backlog.bytes}
    return out


def store_stats(node: NodeParts, *, scan_bucket: bool = True) -> dict[str, Any]:
    """The sections that ask the object store: regions, reachability, bucket size, pins, the last GC."""
    out: dict[str, Any] = {}
    if isinstance(node.store, RegionalStore):
        out["regions"] = _regions(node.store)
    store: dict[str, Any] = {"url": node.store.url}
    try:
        node.store.check()
        store["reachable"] = True
    except KVStoreError as exc:
        store.update(reachable=False, error=str(exc))
    out["store"] = store
    if not store["reachable"]:
        unreachable = {"error": f"object store unreachable: {store['error']}"}
        out["bucket"] = {"skipped": not scan_bucket, **unreachable}
        out["pins"] = dict(unreachable)
        out["last_gc"] = None
        return out
    if scan_bucket:
        try:
            out["bucket"] = {"skipped": False, **asdict(bucket_size(node.store))}
        except KVStoreError as exc:
            out["bucket"] = {"skipped": False, "error": str(exc)}
    else:
        out["bucket"] = {"skipped": True}
    try:
        pins = list_pins(node.store)
        live = sum(1 for p in pins if not p.expired())
        out["pins"] = {"count": len(pins), "live": live}
    except KVStoreError as exc:
        out["pins"] = {"error": str(exc)}
    try:
        reports = list_reports(node.store, 1)
        out["last_gc"] = reports[0] if reports else None
    except KVStoreError as exc:
        out["last_gc"] = {"error": str(exc)}
    return out
