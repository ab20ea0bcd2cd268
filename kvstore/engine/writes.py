"""The write path: chunks onto NVMe and into the upload journal before the caller's buffers are reused.

A store writes each new chunk's file with O_DIRECT straight from the caller's buffer (vLLM's primary region),
on the disk threads in parallel, then commits them all in one index transaction that also queues them for
upload. That is all vLLM's process does: the node agent uploads from the journal. A full disk is met by
making room (evicting) and writing once more, so it never stops caching.

Index writes have a deadline (`index_writes`): a commit that cannot get the index's write lock in time (a
hung node agent holds it) fails the store instead of holding vLLM's job thread, and while one is that late
the next stores fail at once, before writing any file.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.cache import StagedFile
from kvstore.chunk import Codec, flat, stored_size
from kvstore.engine import io
from kvstore.engine.answers import Presence
from kvstore.engine.bad_chunks import count_removals
from kvstore.engine.index_writes import Late
from kvstore.engine.io import Fetched
from kvstore.engine.outcomes import Outcomes
from kvstore.engine.threads import EngineThreads
from kvstore.errors import CacheError, CacheFull

log = logging.getLogger(__name__)

# Object hits are not admitted to a cache that evicts chunks used less than this long ago: such a cache cannot
# keep them until their prompt returns, and writing them (and evicting for them) costs the engine's process.
# Measured with a 64 MiB cache under bench multiturn: 7.4 CPU-s at 32 conversations admitting, 4.8 not.
MIN_ADMIT_HORIZON_S = 60.0


@dataclass(frozen=True)
class StoreOutcome:
    written: int  # admitted to NVMe (and queued for upload when there is a store)
    skipped: int  # already known here or remotely
    failed: int  # not kept: a write error, or no room (the rest is pinned)
    kept_each: tuple[bool, ...] = ()  # per item, in order: kept (written or skipped)

    @property
    def kept(self) -> int:
        return self.written + self.skipped


class Writer:
    def __init__(
        self, outcomes: Outcomes, threads: EngineThreads, *, codec: Codec, element_width: int
    ) -> None:
        self._outcomes = outcomes
        self._threads = threads
        self._codec = codec
        self._width = element_width

    def store_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> StoreOutcome:
        outcomes = self._outcomes
        keys = [key for key, _ in items]
        cached = outcomes.cache.contains_many(keys)
        # One write per key, even when a batch names a key twice (two jobs of one step can).
        first: dict[str, int] = {}
        for i, (key, here) in enumerate(zip(keys, cached, strict=True)):
            if not here and key not in first and outcomes.answer(key) is not Presence.REMOTE:
                first[key] = i
        fresh = [(key, flat(items[i][1])) for key, i in first.items()]
        kept = [True] * len(items)
        if not fresh:
            return StoreOutcome(written=0, skipped=len(items), failed=0, kept_each=tuple(kept))
        if outcomes.index_writes.busy:  # no file written that could not be committed now
            outcomes.metrics.stores_dropped.labels("index_busy").inc(len(fresh))
            for i in first.values():
                kept[i] = False
            return StoreOutcome(0, len(items) - len(fresh), len(fresh), tuple(kept))
        start = time.perf_counter()
        staged = self._write(fresh)
        done = self._commit(staged, since=start)
        for (key, _), ok in zip(fresh, done, strict=True):
            if not ok:
                kept[first[key]] = False
        written = sum(done)
        return StoreOutcome(
            written=written,
            skipped=len(items) - len(fresh),
            failed=len(done) - written,
            kept_each=tuple(kept),
        )

    def _write(self, fresh: list[tuple[str, memoryview]]) -> list[StagedFile | CacheError]:
        """Write the files on the disk threads; where the disk was full, make room and write once more."""
        cache, codec, width = self._outcomes.cache, self._codec, self._width
        threads = self._threads

        def write(item: tuple[str, memoryview]) -> StagedFile | CacheError:
            return io.write_chunk(cache, item[0], item[1], codec, width)

        staged = threads.map(threads.disk, threads.disk_workers, write, fresh)
        full = [i for i, s in enumerate(staged) if isinstance(s, CacheFull)]
        if full:
            need = sum(stored_size(len(fresh[i][1])) for i in full)
            evicted = self._outcomes.index_writes.run(lambda: cache.make_room(need))
            if isinstance(evicted, Late):
                return staged  # no room made in time: those chunks stay unwritten (CacheFull)
            log.warning("NVMe cache's disk is full: evicted %d chunks to make room", len(evicted))
            again = threads.map(threads.disk, threads.disk_workers, write, [fresh[i] for i in full])
            for i, result in zip(full, again, strict=True):
                staged[i] = result
        return staged

    def _commit(self, staged: Sequence[StagedFile | CacheError], *, since: float) -> list[bool]:
        """Index written files in one commit; per item, whether the chunk is on NVMe now (admitted, or
        admitted first by another process)."""
        outcomes = self._outcomes
        metrics = outcomes.metrics
        out = [False] * len(staged)
        at = [i for i, s in enumerate(staged) if isinstance(s, StagedFile)]
        files = [s for s in staged if isinstance(s, StagedFile)]
        for error in (s for s in staged if isinstance(s, CacheError)):
            log.warning("NVMe write failed: %s", error)
            metrics.write_failures.labels("nvme").inc()
            metrics.stores_dropped.labels("write_error").inc()
        if not files:
            return out
        pending = outcomes.store is not None
        try:
            admitted = outcomes.index_writes.run(
                lambda: outcomes.cache.commit(files, pending_upload=pending),
                not_started=lambda: outcomes.cache.abandon(files),
                late=lambda result: self._committed_late(files, result, since),
            )
        except CacheError as exc:
            log.warning("NVMe index commit of %d chunks failed: %s", len(files), exc)
            metrics.write_failures.labels("nvme").inc(len(files))
            metrics.stores_dropped.labels("write_error").inc(len(files))
            return out
        finally:
            count_removals(outcomes.cache, metrics)  # what this commit (or a full disk) evicted
        if isinstance(admitted, Late):
            metrics.stores_dropped.labels("index_busy").inc(len(files))
            return out
        ours: list[StagedFile] = []
        lost: list[tuple[int, StagedFile]] = []
        for i, item, ok in zip(at, files, admitted, strict=True):
            if ok:
                out[i] = True
                ours.append(item)
            else:
                lost.append((i, item))
        if lost:  # another process admitted the key first (it is here), or no room: the rest is pinned
            present = outcomes.cache.contains_many([item.key for _, item in lost])
            for (i, _), here in zip(lost, present, strict=True):
                out[i] = here
                if not here:
                    metrics.stores_dropped.labels("no_room").inc()
        if ours:
            seconds_each = (time.perf_counter() - since) / len(files)
            outcomes.stored([f.key for f in ours], [f.entry.size for f in ours], seconds_each)
        return out

    def _committed_late(self, files: list[StagedFile], result: object, since: float) -> None:
        """A commit its store gave up on finished after all: what it admitted is on NVMe (and queued for
        upload), announced now; what it did not, `commit` removed."""
        count_removals(self._outcomes.cache, self._outcomes.metrics)
        if not isinstance(result, list):
            return  # it failed: commit removed the files
        ours = [f for f, ok in zip(files, result, strict=True) if ok]
        if ours:
            seconds_each = (time.perf_counter() - since) / len(files)
            self._outcomes.stored([f.key for f in ours], [f.entry.size for f in ours], seconds_each)

    def admit_fetched(self, hits: Sequence[Fetched]) -> int:
        """Write verified object-store chunks as they came (their bytes are the files') and admit them in one
        commit, not queued for upload (the bucket has them); how many were admitted."""
        outcomes = self._outcomes
        metrics, cache, threads = outcomes.metrics, outcomes.cache, self._threads
        if outcomes.index_writes.busy:
            return 0  # the index cannot commit now: write nothing it would have to remove
        fresh = [
            hit
            for hit, here in zip(hits, cache.contains_many([h.key for h in hits]), strict=True)
            if not here
        ]
        incoming = sum(memoryview(h.blob).nbytes for h in fresh if h.blob is not None)  # the files' sizes
        horizon = cache.keeps_for_s(incoming) if fresh else None
        if horizon is not None and horizon < MIN_ADMIT_HORIZON_S:
            metrics.admissions_skipped.inc(len(fresh))
            return 0
        staged = threads.map(threads.disk, threads.disk_workers, lambda h: io.write_fetched(cache, h), fresh)
        files = [s for s in staged if isinstance(s, StagedFile)]
        for error in (s for s in staged if isinstance(s, CacheError)):
            log.warning("NVMe write of an object hit failed: %s", error)
            metrics.write_failures.labels("nvme").inc()
        if not files:
            return 0
        try:
            admitted = outcomes.index_writes.run(
                lambda: cache.commit(files),
                not_started=lambda: cache.abandon(files),
                late=lambda result: self._admitted_late(files, result),
            )
        except CacheError as exc:
            log.warning("NVMe admission of %d object hits failed: %s", len(files), exc)
            metrics.write_failures.labels("nvme").inc(len(files))
            return 0
        finally:
            count_removals(cache, metrics)
        if isinstance(admitted, Late):
            return 0
        ours = [f for f, ok in zip(files, admitted, strict=True) if ok]
        metrics.write_bytes.labels("nvme").inc(sum(f.entry.size for f in ours))
        outcomes.on_nvme([f.key for f in ours])
        return len(ours)

    def _admitted_late(self, files: list[StagedFile], result: object) -> None:
        if isinstance(result, list):
            self._outcomes.on_nvme([f.key for f, ok in zip(files, result, strict=True) if ok])
