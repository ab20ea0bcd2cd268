"""The read path: chunks into the caller's buffers, verified, from the fastest tier that has them.

What the probe already fetched, or an earlier load's object hit still waiting for its NVMe write (both
verified when they arrived) -> copied in at memory speed; then NVMe (the index says present) -> O_DIRECT
reads on the disk threads, in parallel (cold reads need queue depth), verified in place; then object GETs on
the io threads, within the load deadline -> verified while copied. What the object store served goes to NVMe
from these very bytes, at a quiet moment (`kvstore.engine.admission`): one GET per hit, none for a repeat.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvstore.cache import CachedChunk, ReadResult, ReadStatus
from kvstore.engine import io
from kvstore.engine.io import Fetched
from kvstore.engine.outcomes import Outcomes
from kvstore.engine.prefetch import PrefetchBuffer
from kvstore.engine.threads import EngineThreads
from kvstore.errors import StoreUnavailable

log = logging.getLogger(__name__)


class Reader:
    def __init__(
        self,
        outcomes: Outcomes,
        prefetched: PrefetchBuffer,
        threads: EngineThreads,
        *,
        load_timeout_s: float,
        admit: Callable[[Sequence[Fetched]], None],
        admitting: Callable[[str], Fetched | None],
    ) -> None:
        """``admit`` takes the verified object hits a load served, to put them on NVMe later;
        ``admitting`` gives back such a hit while it still waits for its write."""
        self._outcomes = outcomes
        self._prefetched = prefetched
        self._threads = threads
        self._load_timeout = load_timeout_s
        self._admit = admit
        self._admitting = admitting
        self._running = 0
        self.started = 0  # loads begun so far
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """Whether a load runs now."""
        return self._running > 0

    def load_into(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        """Fill each buffer with its chunk's raw bytes; True where the chunk was found and verified.
        Buffers whose entry is False may hold garbage and must not be used; their chunks are recorded as
        missing, so lookups stop promising them."""
        with self._lock:
            self._running += 1
            self.started += 1
        try:
            return self._load(items)
        finally:
            with self._lock:
                self._running -= 1

    def _load(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        outcomes = self._outcomes
        out = [False] * len(items)
        # What the probe fetched is in memory and verified: copied in at memory speed, before anything else
        # (an NVMe copy, if another process admitted one meanwhile, would cost a disk read).
        hits = self._take_prefetched(items, out)
        self._copy_admitting(items, out)
        self._load_local(items, [i for i, ok in enumerate(out) if not ok], out)
        missing = [i for i, ok in enumerate(out) if not ok]
        if missing and outcomes.store is not None and outcomes.store_available:
            hits += self._load_remote(items, missing, out)
        if hits:
            outcomes.loaded_from_bucket(hits)
            self._admit(hits)
        failed = [items[i][0] for i, ok in enumerate(out) if not ok]
        if failed:
            outcomes.load_failed(failed)
        return out

    def _take_prefetched(self, items: Sequence[tuple[str, memoryview]], out: list[bool]) -> list[Fetched]:
        hits: list[Fetched] = []
        for i, (key, dest) in enumerate(items):
            held = self._prefetched.take(key)
            if held is None:
                continue
            failure = io.deliver(held, dest)
            if failure is None:
                out[i] = True
                hits.append(held)
            else:
                self._outcomes.not_usable(Fetched(key, held.blob, held.region, error=failure), loading=True)
        return hits

    def _copy_admitting(self, items: Sequence[tuple[str, memoryview]], out: list[bool]) -> None:
        """Copy in what an earlier load served from the bucket and is not on NVMe yet: this node's copy,
        counted as an NVMe read (the bucket is not asked again)."""
        start = time.perf_counter()
        served: list[str] = []
        nbytes = 0
        for i, (key, dest) in enumerate(items):
            if out[i]:
                continue
            held = self._admitting(key)
            if held is None or io.deliver(held, dest) is not None:
                continue  # not held, or for another buffer size: the tiers below answer for it
            assert held.header is not None  # delivered: it was verified
            out[i] = True
            served.append(key)
            nbytes += held.header.raw_length
        if served:
            self._outcomes.loaded_from_nvme(served, nbytes, (time.perf_counter() - start) / len(served))

    def _load_remote(
        self, items: Sequence[tuple[str, memoryview]], missing: list[int], out: list[bool]
    ) -> list[Fetched]:
        """GET what neither the probe nor NVMe had; the hits."""
        hits: list[Fetched] = []
        for i, fetched in zip(missing, self._fetch_all([items[i] for i in missing]), strict=True):
            if fetched is not None and fetched.good:
                out[i] = True
                hits.append(fetched)
            elif fetched is not None:
                self._outcomes.not_usable(fetched, loading=True)
        return hits

    def _load_local(
        self, items: Sequence[tuple[str, memoryview]], wanted: list[int], out: list[bool]
    ) -> None:
        if not wanted:
            return
        cache = self._outcomes.cache
        start = time.perf_counter()
        # One index read for the whole batch: each LMDB transaction hands the GIL away once.
        located = dict(zip(wanted, cache.locate_many([items[i][0] for i in wanted]), strict=True))
        here = [i for i, loc in located.items() if loc is not None]
        if not here:
            return

        def read(i: int) -> ReadResult:
            loc = located[i]
            assert loc is not None
            return cache.read_into(loc, items[i][1])

        threads = self._threads
        results = threads.map(threads.disk, threads.disk_workers, read, here)
        nbytes = 0
        hits: list[str] = []
        for i, result in zip(here, results, strict=True):
            loc = located[i]
            assert loc is not None
            out[i] = self._accept_local(loc, result)
            if out[i]:
                hits.append(loc.key)
                nbytes += loc.raw_length
        if hits:
            self._outcomes.loaded_from_nvme(hits, nbytes, (time.perf_counter() - start) / len(here))

    def _accept_local(self, located: CachedChunk, result: ReadResult) -> bool:
        outcomes = self._outcomes
        key, status = located.key, result.status
        if status is ReadStatus.OK:
            return True
        if status is ReadStatus.GONE:
            outcomes.nvme_file_gone(key, located.path)
        elif status is ReadStatus.REPLACED:
            log.info(
                "NVMe chunk %s is not the one its index entry names, dropping it: %s", key, result.detail
            )
            outcomes.metrics.unreadable.labels("nvme").inc()
            outcomes.nvme_file_gone(key, located.path)
        elif status is ReadStatus.CORRUPT:
            outcomes.nvme_copy_corrupt(key, result.detail)
        elif status is ReadStatus.UNREADABLE:
            log.info("NVMe chunk %s is not for this reader: %s", key, result.detail)
            outcomes.metrics.unreadable.labels("nvme").inc()
        else:
            log.warning("NVMe read of %s failed: %s", key, result.detail)
            outcomes.metrics.load_failures.labels("nvme").inc()
        return False

    def _fetch_all(self, items: Sequence[tuple[str, memoryview]]) -> list[Fetched | None]:
        """GET each chunk into its buffer on the io threads, within the load deadline; None where no
        answer came in time (the breaker then opens: a store that slow is not worth waiting for)."""
        outcomes = self._outcomes
        assert outcomes.store is not None
        batch = io.NetworkBatch(outcomes.store, items)
        deadline = time.monotonic() + self._load_timeout
        results, errors = batch.run(self._threads.io.submit, self._threads.io_workers, deadline)
        failure = next((e for e in errors if e is not None), None)
        if failure is not None:
            outcomes.breaker.failed("get", failure)
        elif any(r is None for r in results):
            outcomes.breaker.failed("get", StoreUnavailable(f"no answer within {self._load_timeout:.1f} s"))
        else:
            outcomes.breaker.succeeded()
        timed_out = sum(result is None for result in results)
        if timed_out:
            outcomes.metrics.load_failures.labels("object").inc(timed_out)
        return results
