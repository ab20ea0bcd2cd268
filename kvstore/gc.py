"""The bucket garbage collector: delete chunks nobody used for a while, then enforce a byte budget.

Object stores keep no access time, so a chunk's last access is the newest of its `last_modified` and the
timestamps of the access records (`_meta/access/`) that name it. `run_gc`:

1. merges the access records into a dict holding only the chunk keys the records name;
2. pass 1 streams `store.list()` and deletes unpinned chunks idle past `ttl_seconds`;
3. pass 2 (only if `max_bytes` is set and the survivors exceed it) deletes survivors oldest-first;
4. compacts the merged access records (not in a dry run) and writes a JSON report under `_meta/gc/reports/`.

Only `.bin` objects outside `_meta/` are chunks; `config.json`, pins, leases, reports and anything foreign are
never touched. Objects younger than `grace_seconds` (by `last_modified`, plus one second because listings
truncate it to whole seconds) and pinned keys always survive.

Ages are judged by the store's clock, never by this host's: `last_modified` is the store's time, so "now" is
too, read off a marker object the run writes at its start (`store_now`). A GC host whose clock runs an hour
ahead would otherwise see every chunk uploaded seconds ago as an hour old. The report states the difference
(`clock_offset_s`).

Pins (the one pin policy: `kvstore gc` and the admin service's `POST /v1/gc` both call `run_gc` with the
node's cache, so they keep the same chunks): the run always reads the bucket's pin manifests itself, under the
lease, and re-reads them (only the changed ones) before every delete batch, inside the pin fence
(`kvstore.pin_fence`) that pin creation also goes through; so no interleaving with `create_pin` deletes a
chunk while a manifest names it. Given the node's NVMe cache (`cache`), chunks pinned there are kept as well
(a pin applied to the node whose manifest is gone, or not yet listed). Chunks chosen before a pin appeared
and spared at delete time count as `kept_pinned`; such a pin may leave the bucket over its byte budget until
the next run.

Memory bound of the budget pass: pass 1 builds a histogram of survivor bytes by age, with logarithmic buckets
1% wide (about 2,000 buckets span a second to decades), so its size does not grow with the bucket. Walking it
from the oldest bucket gives the boundary bucket where the cumulative bytes reach the excess. Pass 2 streams
the listing again: everything older than the boundary bucket is deleted as it streams; members of the boundary
bucket go into a bounded max-heap that keeps only the oldest ones needed to cover the rest of the excess, and
those are deleted at the end. Held in memory: the access dict, the histogram, one delete batch and that heap.

Crash safety: the run holds the `gc` lease (`kvstore.lease`); a crashed run leaves a stale lease that expires,
and a re-run recomputes everything from the bucket, so the work is redone idempotently. Access records are
compacted only after both passes, new records first and old ones deleted last, so a crash loses nothing.
"""

from __future__ import annotations

import collections
import heapq
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Set
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeAlias

from kvstore.access import encode_batch, read_access_records
from kvstore.cache.records import MAX_KEY_BYTES
from kvstore.errors import KVStoreError, StoreUnavailable
from kvstore.layout import ACCESS_PREFIX, GC_CLOCK_PREFIX, GC_REPORT_PREFIX, is_chunk_key
from kvstore.lease import Lease
from kvstore.pin_fence import DeleteFence
from kvstore.pins import PinView
from kvstore.stores import ObjectInfo, ObjectStore

__all__ = ["CachePins", "GCCancelled", "GCReport", "Pinned", "list_reports", "run_gc", "store_now"]

log = logging.getLogger(__name__)

DELETE_BATCH = 1000  # S3 DeleteObjects takes at most 1000 keys per request
COMPACT_BATCH = 50_000  # keys per compacted access record, like the recorder's default flush size
_COMPACT_ROUND_S = 60.0  # compacted timestamps are rounded *up*: a chunk may look younger, never older
_LOG_STEP = math.log(1.01)  # histogram bucket width: 1% of the age
# S3 listings give `last_modified` in whole seconds, truncated: the grace period is stretched by this much.
LISTING_RESOLUTION_S = 1.0

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


def _age_bucket(age: float) -> int:
    """Logarithmic age bucket: larger index = older; ages under a second share bucket 0."""
    return 0 if age < 1.0 else int(math.log(age) / _LOG_STEP) + 1


@dataclass(frozen=True, slots=True)
class _Victim:
    """A chunk chosen for deletion: why (`ttl` or `budget`) and its merged access time, kept in case a pin
    created meanwhile spares it."""

    key: str
    size: int
    reason: str
    ts: float | None


class GCCancelled(KVStoreError):
    """The run was cancelled (`cancel` was set); nothing after the last completed batch was deleted."""


class _Deleter:
    """Batches deletions. Each batch goes through the pin fence (`kvstore.pin_fence`): the pins are re-read
    right before the delete and keys pinned meanwhile are spared (`take_spared`, survivors after all).
    Deleted batches go to `on_removed`; the lease is renewed before each batch."""

    def __init__(
        self,
        store: ObjectStore,
        lease: Lease,
        pins: PinView,
        is_pinned: Callable[[str], bool],
        dry_run: bool,
        on_removed: Callable[[list[str]], None] | None,
        cancel: threading.Event | None,
    ) -> None:
        self._store = store
        self._lease = lease
        self._pins = pins
        self._is_pinned = is_pinned
        self._dry_run = dry_run
        self._on_removed = on_removed
        self._cancel = cancel
        self.fence = DeleteFence(store, lease)
        self._batch: list[_Victim] = []
        self._spared: list[_Victim] = []
        self.deleted: dict[str, int] = {"ttl": 0, "budget": 0}  # in a dry run: would have deleted
        self.freed = 0

    def add(self, victim: _Victim) -> None:
        self._batch.append(victim)
        if len(self._batch) >= DELETE_BATCH:
            self.flush()

    def take_spared(self) -> list[_Victim]:
        """The victims a pin created meanwhile saved at delete time, since the last call."""
        spared, self._spared = self._spared, []
        return spared

    def _split(self, batch: list[_Victim]) -> list[_Victim]:
        doomed = [v for v in batch if not self._is_pinned(v.key)]
        if len(doomed) < len(batch):
            self._spared.extend(v for v in batch if self._is_pinned(v.key))
        return doomed

    def _count(self, done: list[_Victim]) -> None:
        for victim in done:
            self.deleted[victim.reason] += 1
            self.freed += victim.size

    def flush(self) -> None:
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        check_cancel(self._cancel)
        self._lease.renew()  # raises LeaseLost before deleting if another GC took over
        if self._dry_run:
            self._pins.refresh()
            self._count(self._split(batch))
            return
        for _ in range(3):
            with self.fence.batch() as until:
                self._pins.refresh()
                doomed = self._split(batch)
                if not self.fence.in_time(until):
                    batch = doomed  # the re-read took too long to trust the marker: announce again
                    continue
                keys = [v.key for v in doomed]
                if keys:
                    self._store.delete_many(keys)
                self._count(doomed)
                break
        else:
            raise StoreUnavailable("GC could not re-read the pins within its delete window three times")
        if keys and self._on_removed is not None:
            self._on_removed(keys)


def check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise GCCancelled("GC cancelled")


def _merge_access(store: ObjectStore) -> tuple[dict[str, float], list[str]]:
    """Newest access timestamp per chunk key named by a record, and the record keys that were read."""
    last: dict[str, float] = {}
    record_keys: list[str] = []
    for record_key, ts, keys in read_access_records(store):
        record_keys.append(record_key)
        for key in keys:
            if ts > last.get(key, 0.0):
                last[key] = ts
    return last, record_keys


def _chunks(store: ObjectStore, lease: Lease, cancel: threading.Event | None) -> Iterator[ObjectInfo]:
    for i, info in enumerate(store.list()):
        lease.maybe_renew()  # a long listing with nothing to delete must not let the lease lapse
        if i % 1000 == 0:
            check_cancel(cancel)
        if is_chunk_key(info.key):
            yield info


def _boundary(histogram: dict[int, int], excess: int) -> tuple[int, int] | None:
    """The bucket where oldest-first cumulative bytes reach `excess`, and the bytes still needed inside it.

    `None` when all eligible bytes together do not reach the excess (then everything eligible goes)."""
    covered = 0
    for bucket in sorted(histogram, reverse=True):
        size = histogram[bucket]
        if covered + size >= excess:
            return bucket, excess - covered
        covered += size
    return None


class _OldestCovering:
    """The oldest members of the boundary bucket whose bytes cover `need`: a max-heap by last access that
    drops its newest member whenever the others still cover `need`, so it never holds more than that."""

    def __init__(self, need: int) -> None:
        self._need = need
        self._heap: list[tuple[float, str, int]] = []
        self._bytes = 0

    def push(self, last: float, key: str, size: int) -> None:
        heapq.heappush(self._heap, (-last, key, size))
        self._bytes += size
        while self._heap and self._bytes - self._heap[0][2] >= self._need:
            self._bytes -= heapq.heappop(self._heap)[2]

    def oldest_first(self) -> list[tuple[str, int]]:
        return [(key, size) for _, key, size in sorted(self._heap, reverse=True)]


@dataclass
class _Run:
    """One run: its rules, and what its phases find, filled in as they go. Pass 1 (`_ttl_pass`) counts the
    chunks and builds the survivors' age histogram, pass 2 (`_budget_pass`) takes survivors back out, and
    both move the merged access times of surviving chunks from `access` to `live` (what compaction keeps).
    `_report` turns it into the `GCReport`."""

    id: str
    started_at: float  # this host's clock, for the report's name
    now: float  # the store's clock, which ages are judged by
    clock_offset_s: float  # this host's clock minus the store's
    ttl_seconds: float
    grace_seconds: float
    max_bytes: int | None
    dry_run: bool
    is_pinned: Callable[[str], bool]
    deleter: _Deleter
    chunks: Callable[[], Iterator[ObjectInfo]]
    access: dict[str, float]  # merged access records, by chunk key
    record_keys: list[str]
    access_keys: int = 0
    live: dict[str, float] = field(default_factory=dict)
    histogram: dict[int, int] = field(default_factory=lambda: collections.defaultdict(int))
    objects: int = 0  # chunk objects counted in pass 1
    bytes_total: int = 0
    kept_pinned: int = 0
    kept_young: int = 0
    remaining_objects: int = 0
    remaining_bytes: int = 0
    records_compacted: int = 0

    @property
    def over_budget(self) -> bool:
        return self.max_bytes is not None and self.remaining_bytes > self.max_bytes

    def young(self, info: ObjectInfo) -> bool:
        # Listings carry whole seconds, truncated: an object may be up to a second younger than it looks.
        return self.now - info.last_modified < self.grace_seconds + LISTING_RESOLUTION_S

    def last_access(self, info: ObjectInfo, ts: float | None) -> float:
        """The chunk's last access: the newest of its write and the access records naming it."""
        return info.last_modified if ts is None else max(ts, info.last_modified)

    def idle(self, last: float) -> bool:
        return self.now - last > self.ttl_seconds

    def keep(self, key: str, size: int, ts: float | None) -> None:
        self.remaining_objects += 1
        self.remaining_bytes += size
        if ts is not None:
            self.live[key] = ts

    def drop(self, key: str, size: int) -> None:
        """A survivor of pass 1 goes after all (to the byte budget)."""
        self.deleter.add(_Victim(key, size, "budget", self.live.pop(key, None)))
        self.remaining_objects -= 1
        self.remaining_bytes -= size

    def settle(self) -> None:
        """Flush the deletes; victims a late pin saved at delete time are survivors after all."""
        self.deleter.flush()
        for victim in self.deleter.take_spared():
            self.kept_pinned += 1
            self.keep(victim.key, victim.size, victim.ts)


def _ttl_pass(run: _Run) -> None:
    """Pass 1: count every chunk; delete the unpinned ones idle past the TTL; histogram the others' ages."""
    for info in run.chunks():
        run.objects += 1
        run.bytes_total += info.size
        ts = run.access.pop(info.key, None)
        if run.is_pinned(info.key):
            run.kept_pinned += 1
        elif run.young(info):
            run.kept_young += 1
        else:
            last = run.last_access(info, ts)
            if run.idle(last):
                run.deleter.add(_Victim(info.key, info.size, "ttl", ts))
                continue
            run.histogram[_age_bucket(run.now - last)] += info.size
        run.keep(info.key, info.size, ts)
    run.settle()
    # What is left names objects that no longer exist: compaction drops it.
    run.access.clear()


def _budget_pass(run: _Run) -> None:
    """Pass 2: delete survivors oldest-first until the bucket fits `max_bytes` (see the module docstring)."""
    assert run.max_bytes is not None
    bound = _boundary(run.histogram, run.remaining_bytes - run.max_bytes)
    boundary, need = bound if bound is not None else (-1, 0)
    oldest = _OldestCovering(need)
    for info in run.chunks():
        if run.is_pinned(info.key) or run.young(info):
            continue
        last = run.last_access(info, run.live.get(info.key))
        if run.idle(last):
            continue  # pass 1 handled it (still listed in a dry run)
        bucket = _age_bucket(run.now - last)
        if bucket > boundary:
            run.drop(info.key, info.size)
        elif bucket == boundary:
            oldest.push(last, info.key, info.size)
    for key, size in oldest.oldest_first():
        run.drop(key, size)
    run.settle()


def _compact(store: ObjectStore, live: dict[str, float], record_keys: list[str], run_id: str) -> int:
    """Rewrite the surviving keys' access times as a few records, then delete the records they came from."""
    by_ts: dict[float, list[str]] = collections.defaultdict(list)
    for key, ts in live.items():
        by_ts[math.ceil(ts / _COMPACT_ROUND_S) * _COMPACT_ROUND_S].append(key)
    seq = 0
    for ts, keys in sorted(by_ts.items()):
        hour = time.strftime("%Y%m%d%H", time.gmtime(ts))
        for start in range(0, len(keys), COMPACT_BATCH):
            seq += 1
            name = f"{ACCESS_PREFIX}{hour}/gc-{run_id}-{seq:06d}.json.zst"
            store.put(name, encode_batch(keys[start : start + COMPACT_BATCH], ts))
    for start in range(0, len(record_keys), DELETE_BATCH):
        store.delete_many(record_keys[start : start + DELETE_BATCH])
    return len(record_keys)


def _report_key(started_at: float, run_id: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(started_at))
    millis = int((started_at % 1) * 1000)
    return f"{GC_REPORT_PREFIX}{stamp}.{millis:03d}Z-{run_id}.json"


def store_now(store: ObjectStore, run_id: str) -> float:
    """The store's clock now: the `last_modified` it gives a marker this call writes (and then deletes).
    Listings truncate it to whole seconds, so it is never ahead of the store's time: ages come out a little
    short, which keeps chunks rather than deleting them."""
    key = f"{GC_CLOCK_PREFIX}{run_id}"
    store.put(key, b"")
    try:
        for _ in range(3):  # a store whose listings lag its writes lists it on a later try
            listed = [info.last_modified for info in store.list(key) if info.key == key]
            if listed:
                return listed[0]
            time.sleep(0.1)
        raise StoreUnavailable(f"the store does not list {key} it just wrote: cannot read its clock")
    finally:
        store.delete(key)


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
        access, record_keys = _merge_access(store)
        run = _Run(
            id=run_id,
            started_at=started_at,
            now=now,
            clock_offset_s=offset,
            ttl_seconds=ttl_seconds,
            grace_seconds=grace_seconds,
            max_bytes=max_bytes,
            dry_run=dry_run,
            is_pinned=is_pinned,
            deleter=_Deleter(store, lease, pins, is_pinned, dry_run, on_removed, cancel),
            chunks=lambda: _chunks(store, lease, cancel),
            access=access,
            record_keys=record_keys,
            access_keys=len(access),
        )
        _ttl_pass(run)
        if run.over_budget:
            _budget_pass(run)
        if compact and not dry_run and record_keys:
            lease.renew()
            run.records_compacted = _compact(store, run.live, record_keys, run_id)
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


def _report(run: _Run, *, pin_manifests: int, duration_s: float) -> GCReport:
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
