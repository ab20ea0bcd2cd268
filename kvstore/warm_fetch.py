"""Chunks of the bucket into this node's NVMe cache: GET, verify, admit (warming's prefetch, `kvstore.warm`).

Engines admit the object hits they serve from the bytes their load verified (`kvstore.engine.admission`);
this is for chunks nobody on the node asked for yet. A chunk that fails its check follows `bad_chunks`'
rule and is not admitted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.cache import NVMeCache, StagedFile
from kvstore.engine import io
from kvstore.engine.bad_chunks import object_not_usable
from kvstore.engine.breaker import Breaker
from kvstore.engine.threads import EngineThreads
from kvstore.errors import CacheError, StoreError
from kvstore.metrics import EngineMetrics
from kvstore.stores import ObjectStore

__all__ = ["Admitted", "fetch_into_cache"]

log = logging.getLogger(__name__)

_BATCH = 64  # chunks fetched and held in memory at once


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
            fetched = _fetch(store, threads, batch)
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


def _fetch(store: ObjectStore, threads: EngineThreads, keys: list[str]) -> list[io.Fetched]:
    """GET and verify ``keys``: in flight together on this thread where the store offers it, else one GET
    per io thread."""
    if store.gets_many_at_once:
        return io.fetch_each(store, keys, at_once=threads.io_workers)
    return threads.map(threads.io, threads.io_workers, lambda k: io.fetch(store, k), keys)


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
