"""What every path of the engine decides with: the answers, the breaker, the events, and the rules for a
chunk that turns out bad.

The probe, the read path and the write path (``prober``, ``reads``, ``writes``) each own their own work and
share this one object, so a chunk is judged the same way whichever path meets it: only proven corruption of
a chunk in a format this reader knows removes it (its NVMe copy, or the shared object); one this reader
cannot interpret (another version, codec or buffer size) is a miss and is left alone.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.cache import NVMeCache
from kvstore.engine.activity import Activity
from kvstore.engine.breaker import Breaker
from kvstore.engine.io import Fetched
from kvstore.engine.probes import AnswerCache, Presence
from kvstore.engine.threads import EngineThreads
from kvstore.errors import ChunkCorrupt, StoreError
from kvstore.metrics import EngineMetrics
from kvstore.stores import ObjectStore

log = logging.getLogger(__name__)

_MAX_EVENTS = 65_536


@dataclass(frozen=True)
class ChunkEvent:
    """A chunk became available in, or left, a tier (the vLLM tier turns these into KV events)."""

    key: str
    tier: str  # "nvme" | "object"
    removed: bool


class EngineState:
    def __init__(
        self,
        store: ObjectStore | None,
        cache: NVMeCache | None,
        *,
        metrics: EngineMetrics,
        threads: EngineThreads,
        breaker: Breaker,
        answers: AnswerCache,
        activity: Activity,
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.cache = cache
        self.metrics = metrics
        self.threads = threads
        self.breaker = breaker
        self.answers = answers
        self.clock = clock
        self.events: deque[ChunkEvent] = deque(maxlen=_MAX_EVENTS)
        self.activity = activity

    @property
    def store_available(self) -> bool:
        return self.store is not None and self.breaker.available()

    def emit(self, key: str, tier: str, *, removed: bool) -> None:
        self.events.append(ChunkEvent(key, tier, removed))

    def object_miss(self, fetched: Fetched, *, loading: bool = True) -> None:
        """An object that is missing or not usable. Only proven corruption deletes the shared object
        (content-addressed: the next store of this prefix uploads it again)."""
        assert self.store is not None
        key, error = fetched.key, fetched.error
        self.answers.set(key, Presence.MISS)
        if error is None:
            if loading:  # promised by a probe, gone by the load (GC, another region's outage)
                self.metrics.load_failures.labels("object").inc()
        elif isinstance(error, ChunkCorrupt):
            log.warning("deleting corrupt object %s: %s", key, error)
            self.metrics.checksum_failures.labels("object").inc()
            with contextlib.suppress(StoreError):
                self.store.delete(key)
            self.emit(key, "object", removed=True)
        else:
            log.info("object %s is not for this reader, leaving it alone: %s", key, error)
            self.metrics.unreadable.labels("object").inc()

    def damaged_on_nvme(self, key: str, why: str) -> None:
        """A node-local copy proven bad: discard it (the bucket's copy, if any, still serves)."""
        assert self.cache is not None
        log.warning("discarding corrupt NVMe chunk %s: %s", key, why)
        self.metrics.checksum_failures.labels("nvme").inc()
        self.cache.discard(key)
        self.answers.forget(key)
        self.emit(key, "nvme", removed=True)
        self.count_lost_uploads()

    def object_hits(self, hits: Sequence[Fetched]) -> None:
        """Verified object-store chunks served: metrics, regions and answers."""
        seconds = self.metrics.read_seconds.labels("object")
        nbytes = 0
        for hit in hits:
            assert hit.header is not None
            seconds.observe(hit.seconds)
            nbytes += hit.header.raw_length
            if hit.region is not None:  # several regions: which one served it
                self.metrics.region_hits.labels(hit.region).inc()
            if self.answers.get(hit.key) is not Presence.LOCAL:
                self.answers.set(hit.key, Presence.REMOTE)
        self.metrics.read_bytes.labels("object").inc(nbytes)

    def after_removals(self) -> None:
        """What the cache removed on its own (evictions, stale entries): answers, metrics, events."""
        assert self.cache is not None
        evicted = self.cache.take_evicted()
        if evicted:
            self.metrics.evictions.inc(len(evicted))
            for gone in evicted:
                self.answers.forget(gone)
                self.emit(gone, "nvme", removed=True)
        self.count_lost_uploads()

    def count_lost_uploads(self) -> None:
        assert self.cache is not None
        for reason, n in self.cache.take_lost_uploads().items():
            self.metrics.uploads_lost.labels(reason).inc(n)
