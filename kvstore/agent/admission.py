"""Object-store chunks into the node's NVMe cache: the agent's admission of engines' object hits, and warming.

An engine that served a chunk from the object store tells the agent (a hint: the key, never the bytes); the
agent fetches it again at idle priority, verifies it and admits it, so the next hit on this node stays on
the node. The engine's request never waits for this, and vLLM's process spends nothing on it. Warming a
prompt into a node's cache (`kvstore warm`, the admin API) goes through the same `fetch_into_cache`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvstore.cache import NVMeCache, StagedFile
from kvstore.engine import io
from kvstore.engine.bad_chunks import object_not_usable
from kvstore.engine.breaker import Breaker
from kvstore.engine.threads import EngineThreads
from kvstore.errors import CacheError, KVStoreError, StoreError
from kvstore.metrics import EngineMetrics
from kvstore.stores import ObjectStore

log = logging.getLogger(__name__)

_BATCH = 64  # chunks fetched and held in memory at once
_MAX_QUEUED = (
    65_536  # keys waiting for admission; past this the oldest are forgotten (a later hit asks again)
)


@dataclass(frozen=True)
class Admitted:
    """What `fetch_into_cache` did: chunks it wrote, chunks already there, and chunks it could not get."""

    written: int = 0
    present: int = 0
    missing: int = 0

    def __add__(self, other: Admitted) -> Admitted:
        return Admitted(
            self.written + other.written, self.present + other.present, self.missing + other.missing
        )


def fetch_into_cache(
    cache: NVMeCache,
    store: ObjectStore,
    threads: EngineThreads,
    keys: Sequence[str],
    metrics: EngineMetrics,
    *,
    breaker: Breaker | None = None,
    cancel: threading.Event | None = None,
) -> Admitted:
    """GET the chunks of ``keys`` not on NVMe yet, verify them and admit them (one commit per batch of
    ``_BATCH``). Stops before the next batch once ``cancel`` is set or the store fails (``breaker``)."""
    total = Admitted()
    here = cache.contains_many(keys)
    wanted = [k for k, cached in zip(keys, here, strict=True) if not cached]
    total += Admitted(present=len(keys) - len(wanted))
    for start in range(0, len(wanted), _BATCH):
        if (cancel is not None and cancel.is_set()) or (breaker is not None and not breaker.available()):
            total += Admitted(missing=len(wanted) - start)
            break
        batch = wanted[start : start + _BATCH]
        try:
            fetched = threads.map(threads.io, threads.io_workers, lambda k: io.fetch(store, k), batch)
        except StoreError as exc:
            if breaker is not None:
                breaker.failed("get", exc)
            total += Admitted(missing=len(wanted) - start)
            break
        if breaker is not None:
            breaker.succeeded()
        good = [f for f in fetched if f.good]
        for bad in (f for f in fetched if not f.good):
            object_not_usable(store, bad, metrics)
        metrics.read_bytes.labels("object").inc(sum(f.header.total_length for f in good if f.header))
        written = _admit(cache, threads, good, metrics)
        total += Admitted(written=written, present=len(good) - written, missing=len(batch) - len(good))
    return total


def _admit(cache: NVMeCache, threads: EngineThreads, hits: list[io.Fetched], metrics: EngineMetrics) -> int:
    """Write verified chunks as they came and commit them in one transaction; how many were admitted."""
    staged = threads.map(threads.disk, threads.disk_workers, lambda h: io.write_fetched(cache, h), hits)
    files = [s for s in staged if isinstance(s, StagedFile)]
    for error in (s for s in staged if isinstance(s, CacheError)):
        log.warning("NVMe write of a fetched chunk failed: %s", error)
        metrics.write_failures.labels("nvme").inc()
    if not files:
        return 0
    try:
        admitted = cache.commit(files)
    except CacheError as exc:
        log.warning("NVMe admission of %d chunks failed: %s", len(files), exc)
        metrics.write_failures.labels("nvme").inc(len(files))
        return 0
    metrics.write_bytes.labels("nvme").inc(
        sum(f.entry.size for f, ok in zip(files, admitted, strict=True) if ok)
    )
    return sum(admitted)


class Admitter:
    """The agent's queue of object hits to admit: deduplicated, bounded, drained by one loop."""

    def __init__(
        self,
        cache: NVMeCache,
        store: ObjectStore,
        threads: EngineThreads,
        breaker: Breaker,
        metrics: EngineMetrics,
    ) -> None:
        self._cache = cache
        self._store = store
        self._threads = threads
        self._breaker = breaker
        self._metrics = metrics
        self._queued: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.admitted = 0

    def offer(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._queued[key] = None
            while len(self._queued) > _MAX_QUEUED:
                self._queued.popitem(last=False)
        self._wake.set()

    @property
    def queued(self) -> int:
        return len(self._queued)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def run(self) -> None:
        """The admission loop (one service thread); returns after ``stop``."""
        while not self._stopping.is_set():
            with self._lock:
                batch = [self._queued.popitem(last=False)[0] for _ in range(min(_BATCH, len(self._queued)))]
            if not batch or not self._breaker.available():
                self._wake.wait(0.5)
                self._wake.clear()
                if batch:
                    self.offer(batch)  # the store is down: keep them for later
                continue
            try:
                done = fetch_into_cache(
                    self._cache, self._store, self._threads, batch, self._metrics, breaker=self._breaker
                )
            except KVStoreError as exc:  # the index failed: these hits are simply not cached
                log.warning("admission of %d object hits failed: %s", len(batch), exc)
                continue
            except Exception:
                log.exception("admission of %d object hits failed", len(batch))
                continue
            self.admitted += done.written
