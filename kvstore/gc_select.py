"""Choosing what GC deletes: the bucket's chunks listed, judged against the merged access times, in two
passes.

1. pass 1 (`ttl_pass`) streams `store.list()`, counts every chunk and deletes the unpinned ones idle past
   `ttl_seconds`; the survivors' bytes go into a histogram by age;
2. pass 2 (`budget_pass`, only if `max_bytes` is set and the survivors exceed it) deletes survivors
   oldest-first.

Only `.bin` objects outside `_meta/` are chunks; `config.json`, pins, leases, reports and anything foreign are
never touched. Objects younger than `grace_seconds` (by `last_modified`, plus one second because listings
truncate it to whole seconds) and pinned keys always survive. Ages are judged by the store's clock
(`kvstore.store_clock`): `Run.now` is the store's time.

Memory bound of the budget pass: pass 1 builds a histogram of survivor bytes by age, with logarithmic buckets
1% wide (about 2,000 buckets span a second to decades), so its size does not grow with the bucket. Walking it
from the oldest bucket gives the boundary bucket where the cumulative bytes reach the excess. Pass 2 streams
the listing again: everything older than the boundary bucket is deleted as it streams; members of the boundary
bucket go into a bounded max-heap that keeps only the oldest ones needed to cover the rest of the excess, and
those are deleted at the end. Held in memory: the access dict, the histogram, one delete batch and that heap.
"""

from __future__ import annotations

import collections
import heapq
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvstore.gc_delete import Deleter, Victim, check_cancel
from kvstore.layout import is_chunk_key
from kvstore.lease import Lease
from kvstore.store_clock import LISTING_RESOLUTION_S
from kvstore.stores import ObjectInfo, ObjectStore

__all__ = ["Run", "budget_pass", "list_chunks", "ttl_pass"]

_LOG_STEP = math.log(1.01)  # histogram bucket width: 1% of the age


def _age_bucket(age: float) -> int:
    """Logarithmic age bucket: larger index = older; ages under a second share bucket 0."""
    return 0 if age < 1.0 else int(math.log(age) / _LOG_STEP) + 1


def list_chunks(store: ObjectStore, lease: Lease, cancel: threading.Event | None) -> Iterator[ObjectInfo]:
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
class Run:
    """One run: its rules, and what its phases find, filled in as they go. Pass 1 (`ttl_pass`) counts the
    chunks and builds the survivors' age histogram, pass 2 (`budget_pass`) takes survivors back out, and
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
    deleter: Deleter
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
        self.deleter.add(Victim(key, size, "budget", self.live.pop(key, None)))
        self.remaining_objects -= 1
        self.remaining_bytes -= size

    def settle(self) -> None:
        """Flush the deletes; victims a late pin saved at delete time are survivors after all."""
        self.deleter.flush()
        for victim in self.deleter.take_spared():
            self.kept_pinned += 1
            self.keep(victim.key, victim.size, victim.ts)


def ttl_pass(run: Run) -> None:
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
                run.deleter.add(Victim(info.key, info.size, "ttl", ts))
                continue
            run.histogram[_age_bucket(run.now - last)] += info.size
        run.keep(info.key, info.size, ts)
    run.settle()
    # What is left names objects that no longer exist: compaction drops it.
    run.access.clear()


def budget_pass(run: Run) -> None:
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
