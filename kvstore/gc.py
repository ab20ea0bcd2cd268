"""The bucket garbage collector: delete chunks nobody used for a while, then enforce a byte budget.

`run_gc` is one run, in the order its parts do the work:

1. it takes the `gc` lease and reads the pins;
2. merges the access records into last-use times (`kvstore.gc_access`);
3. lists the bucket and chooses what goes: pass 1 deletes unpinned chunks idle past `ttl_seconds`, pass 2
   (only if `max_bytes` is set and the survivors exceed it) deletes survivors oldest-first
   (`kvstore.gc_select`), through batched deletes that re-check the pins (`kvstore.gc_delete`);
4. compacts the merged access records (not in a dry run) and writes a JSON report under `_meta/gc/reports/`.

Ages are judged by the store's clock, never by this host's (`kvstore.store_clock`): `last_modified` is the
store's time, so "now" is too, read off a marker object the run writes at its start. The report states the
difference (`clock_offset_s`).

Pins (the one pin policy: `kvstore gc` and the admin service's `POST /v1/gc` both call `run_gc` with the
node's cache, so they keep the same chunks): the run always reads the bucket's pin manifests itself, under the
lease, and re-reads them (only the changed ones) before every delete batch, inside the pin fence
(`kvstore.pin_fence`) that pin creation also goes through; so no interleaving with `create_pin` deletes a
chunk while a manifest names it. Given the node's NVMe cache (`cache`), chunks pinned there are kept as well
(a pin applied to the node whose manifest is gone, or not yet listed). Chunks chosen before a pin appeared
and spared at delete time count as `kept_pinned`; such a pin may leave the bucket over its byte budget until
the next run.

Crash safety: the run holds the `gc` lease (`kvstore.lease`); a crashed run leaves a stale lease that expires
(or is taken over at once on the same machine), and a re-run recomputes everything from the bucket, so the
work is redone idempotently. Access records are compacted only after both passes, new records first and old
ones deleted last, so a crash loses nothing.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Set
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeAlias

from kvstore.cache.records import MAX_KEY_BYTES
from kvstore.gc_access import compact_records, merge_access
from kvstore.gc_delete import Deleter, GCCancelled
from kvstore.gc_select import Run, budget_pass, list_chunks, ttl_pass
from kvstore.layout import GC_REPORT_PREFIX
from kvstore.lease import Lease
from kvstore.pins import PinView
from kvstore.store_clock import LISTING_RESOLUTION_S, store_now
from kvstore.stores import ObjectStore

__all__ = [
    "DELETE_BATCH",
    "LISTING_RESOLUTION_S",
    "CachePins",
    "GCCancelled",
    "GCReport",
    "Pinned",
    "list_reports",
    "run_gc",
    "store_now",
]

log = logging.getLogger(__name__)

DELETE_BATCH = 1000  # S3 DeleteObjects takes at most 1000 keys per request; read at each run's start

Pinned: TypeAlias = Callable[[str], bool] | Set[str]


class CachePins(Protocol):
    """What GC asks of a node's NVMe cache (`kvstore.cache.NVMeCache`): a key's pin count there."""

    def pinned(self, key: str) -> int: ...


@dataclass(frozen=True)
class GCReport:
    """What one run saw and did. In a dry run `deleted*` and `bytes_freed` are what it would have deleted."""

    id: str
    started_at: float  # this host's clock
    clock_offset_s: (
        float  # this host's clock minus the store's (listings' whole seconds: +-1 s); ages follow the store's
    )
    duration_s: float
    dry_run: bool
    ttl_seconds: float
    max_bytes: int | None
    grace_seconds: float
    objects: int  # chunk objects counted in pass 1
    bytes_total: int
    deleted: int
    deleted_ttl: int
    deleted_budget: int
    bytes_freed: int
    kept_pinned: int  # pinned chunks seen (all of them survive)
    kept_young: int  # unpinned chunks younger than the grace period (all of them survive)
    remaining_objects: int
    remaining_bytes: int
    over_budget: bool  # still above max_bytes because only pinned/young bytes are left
    access_records: int
    access_keys: int
    records_compacted: int
    pin_manifests: int  # live pin manifests the run honoured (created during the run included)
    pin_fence_wait_s: float  # time the deletes waited for pins being created
    report_key: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pin_check(pinned: Pinned) -> Callable[[str], bool]:
    if callable(pinned):
        return pinned
    pinned_set = pinned
    return lambda key: key in pinned_set


def _pin_policy(
    pins: PinView, cache: CachePins | None, extra: Callable[[str], bool]
) -> Callable[[str], bool]:
    """Whether a chunk is pinned: by a manifest in the bucket, in the node's cache, or by the caller."""

    def is_pinned(key: str) -> bool:
        # A key too long for the cache's index can be pinned there by no one (and asking would raise).
        in_cache = cache is not None and len(key.encode()) <= MAX_KEY_BYTES and cache.pinned(key) > 0
        return key in pins or in_cache or extra(key)

    return is_pinned


def _report_key(started_at: float, run_id: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(started_at))
    millis = int((started_at % 1) * 1000)
    return f"{GC_REPORT_PREFIX}{stamp}.{millis:03d}Z-{run_id}.json"


def _check_seconds(name: str, value: float) -> None:
    # `not value >= 0` also refuses NaN, which every comparison below would silently treat as "keep all".
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def run_gc(
    store: ObjectStore,
    *,
    ttl_seconds: float,
    max_bytes: int | None = None,
    grace_seconds: float,
    dry_run: bool = False,
    cache: CachePins | None = None,
    pinned: Pinned = frozenset(),
    now: float | None = None,
    on_removed: Callable[[list[str]], None] | None = None,
    holder: str | None = None,
    lease_ttl_s: float = 300.0,
    compact: bool = True,
    cancel: threading.Event | None = None,
) -> GCReport:
    """Run one GC pass over `store` (see the module docstring). Raises `LeaseHeld` if another GC runs,
    `GCCancelled` once `cancel` is set (checked between listing pages and before each delete batch).

    The pin policy is decided here, the same for every caller: the pin manifests in the bucket are always
    honoured (read under the lease and re-read before every delete batch through the pin fence, so a pin
    created while GC runs never loses a chunk), and so are the pins of `cache`, the node's NVMe cache, when
    GC runs on a node (the CLI and the admin service pass it). `pinned` adds keys kept for other reasons (a
    key predicate or a set). `now` is the time by the store's clock that GC judges ages by (default: read off
    the store, `store_now`; tests advance it instead of sleeping); `on_removed` gets each deleted batch (never
    called in a dry run)."""
    _check_seconds("ttl_seconds", ttl_seconds)
    _check_seconds("grace_seconds", grace_seconds)
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    extra_pins = _pin_check(pinned)
    started_at = time.time()
    clock = time.monotonic()
    run_id = uuid.uuid4().hex[:12]

    with Lease(store, "gc", ttl_s=lease_ttl_s, holder=holder) as lease:
        pins = PinView(store)
        pins.refresh()

        is_pinned = _pin_policy(pins, cache, extra_pins)
        if now is None:
            now = store_now(store, run_id)
        offset = time.time() - now
        access, record_keys = merge_access(store)
        run = Run(
            id=run_id,
            started_at=started_at,
            now=now,
            clock_offset_s=offset,
            ttl_seconds=ttl_seconds,
            grace_seconds=grace_seconds,
            max_bytes=max_bytes,
            dry_run=dry_run,
            is_pinned=is_pinned,
            deleter=Deleter(store, lease, pins, is_pinned, dry_run, on_removed, cancel, DELETE_BATCH),
            chunks=lambda: list_chunks(store, lease, cancel),
            access=access,
            record_keys=record_keys,
            access_keys=len(access),
        )
        ttl_pass(run)
        if run.over_budget:
            budget_pass(run)
        if compact and not dry_run and record_keys:
            lease.renew()
            run.records_compacted = compact_records(store, run.live, record_keys, run_id)
        report = _report(run, pin_manifests=pins.manifests, duration_s=time.monotonic() - clock)
        store.put(report.report_key, json.dumps(report.as_dict(), indent=1).encode())
    log.info(
        "gc %s: %d objects, deleted %d (%d bytes)%s",
        run_id,
        report.objects,
        report.deleted,
        report.bytes_freed,
        " [dry run]" if dry_run else "",
    )
    return report


def _report(run: Run, *, pin_manifests: int, duration_s: float) -> GCReport:
    deleted = run.deleter.deleted
    return GCReport(
        id=run.id,
        started_at=run.started_at,
        clock_offset_s=round(run.clock_offset_s, 3),
        duration_s=round(duration_s, 6),
        dry_run=run.dry_run,
        ttl_seconds=run.ttl_seconds,
        max_bytes=run.max_bytes,
        grace_seconds=run.grace_seconds,
        objects=run.objects,
        bytes_total=run.bytes_total,
        deleted=deleted["ttl"] + deleted["budget"],
        deleted_ttl=deleted["ttl"],
        deleted_budget=deleted["budget"],
        bytes_freed=run.deleter.freed,
        kept_pinned=run.kept_pinned,
        kept_young=run.kept_young,
        remaining_objects=run.remaining_objects,
        remaining_bytes=run.remaining_bytes,
        over_budget=run.over_budget,
        access_records=len(run.record_keys),
        access_keys=run.access_keys,
        records_compacted=run.records_compacted,
        pin_manifests=pin_manifests,
        pin_fence_wait_s=round(run.deleter.fence.waited_s, 3),
        report_key=_report_key(run.started_at, run.id),
    )


def list_reports(store: ObjectStore, limit: int = 20) -> list[dict[str, Any]]:
    """The newest `limit` GC reports, newest first (keys sort by start time)."""
    if limit <= 0:
        return []
    newest: collections.deque[str] = collections.deque(maxlen=limit)
    for info in store.list(GC_REPORT_PREFIX):
        if info.key.endswith(".json"):
            newest.append(info.key)
    out: list[dict[str, Any]] = []
    for key in reversed(newest):
        blob = store.get(key)
        if blob is None:
            continue  # removed between listing and reading
        try:
            out.append(json.loads(blob))
        except ValueError:
            log.warning("skipping unreadable GC report %s", key)
    return out
