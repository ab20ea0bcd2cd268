"""The write path: chunks onto NVMe and into the upload journal before the caller's buffers are reused.

A store writes each new chunk's file with O_DIRECT straight from the caller's buffer (vLLM's primary region),
on the disk threads in parallel, then commits them all in one index transaction that also queues them for
upload; the uploader drains the journal in the background. A node without NVMe PUTs before returning. The
same commit path admits verified object-store chunks (object hits, warming), minus the upload.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.cache import StagedFile
from kvstore.chunk import Codec, encode, flat
from kvstore.engine import io
from kvstore.engine.io import Fetched
from kvstore.engine.probes import Presence
from kvstore.engine.state import EngineState
from kvstore.errors import CacheError, StoreError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreOutcome:
    written: int  # admitted to NVMe (and queued for upload when there is a store)
    skipped: int  # already known here or remotely
    failed: int  # not kept: a write error, no room (the rest is pinned), or no store to take it
    uploaded: int = 0  # PUT directly (a node without an NVMe cache)
    kept_each: tuple[bool, ...] = ()  # per item, in order: kept (written, skipped or uploaded)

    @property
    def kept(self) -> int:
        return self.written + self.skipped + self.uploaded


class Writer:
    def __init__(self, state: EngineState, *, codec: Codec, element_width: int) -> None:
        self._state = state
        self._codec = codec
        self._width = element_width

    def store_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> StoreOutcome:
        with self._state.activity.foreground():
            return self._store_many(items)

    def _store_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> StoreOutcome:
        state = self._state
        keys = [key for key, _ in items]
        cached = state.cache.contains_many(keys) if state.cache is not None else [False] * len(items)
        # One write per key, even when a batch names a key twice (two jobs of one step can).
        first: dict[str, int] = {}
        for i, (key, here) in enumerate(zip(keys, cached, strict=True)):
            if not here and key not in first and state.answers.get(key) is not Presence.REMOTE:
                first[key] = i
        fresh = [(key, flat(items[i][1])) for key, i in first.items()]
        kept = [True] * len(items)
        skipped = len(items) - len(fresh)
        if not fresh:
            return StoreOutcome(written=0, skipped=skipped, failed=0, kept_each=tuple(kept))
        if state.cache is None:
            done = self._put_direct(fresh)
        else:
            cache = state.cache
            codec, width = self._codec, self._width
            start = time.perf_counter()
            staged = state.threads.map(
                state.threads.disk,
                state.threads.disk_workers,
                lambda item: io.write_chunk(cache, item[0], item[1], codec, width),
                fresh,
            )
            done = self.commit(staged, pending_upload=state.store is not None, since=start)
        for (key, _), ok in zip(fresh, done, strict=True):
            if not ok:
                kept[first[key]] = False
        failed = len(done) - sum(done)
        written = sum(done) if state.cache is not None else 0
        return StoreOutcome(
            written=written,
            skipped=skipped,
            failed=failed,
            uploaded=0 if state.cache is not None else sum(done),
            kept_each=tuple(kept),
        )

    def admit_fetched(self, hits: list[Fetched]) -> None:
        """Admit verified object-store chunks to NVMe (object hits, warming): written as they came."""
        state = self._state
        cache = state.cache
        assert cache is not None
        start = time.perf_counter()
        here = cache.contains_many([h.key for h in hits])
        fresh = [h for h, cached in zip(hits, here, strict=True) if not cached]
        staged = state.threads.map(
            state.threads.disk, state.threads.disk_workers, lambda h: io.write_fetched(cache, h), fresh
        )
        self.commit(staged, pending_upload=False, since=start)

    def commit(
        self, staged: Sequence[StagedFile | CacheError], *, pending_upload: bool, since: float
    ) -> list[bool]:
        """Index written files in one commit; per item, whether the chunk is on NVMe now (admitted, or
        admitted first by another process). Answers, metrics and events follow."""
        state = self._state
        assert state.cache is not None
        metrics = state.metrics
        out = [False] * len(staged)
        at = [i for i, s in enumerate(staged) if isinstance(s, StagedFile)]
        files = [s for s in staged if isinstance(s, StagedFile)]
        for error in (s for s in staged if isinstance(s, CacheError)):
            log.warning("NVMe write failed: %s", error)
            metrics.write_failures.labels("nvme").inc()
            metrics.stores_dropped.labels("write_error").inc()
        if not files:
            return out
        try:
            admitted = state.cache.commit(files, pending_upload=pending_upload)
        except CacheError as exc:
            log.warning("NVMe index commit of %d chunks failed: %s", len(files), exc)
            metrics.write_failures.labels("nvme").inc(len(files))
            metrics.stores_dropped.labels("write_error").inc(len(files))
            return out
        per_chunk = (time.perf_counter() - since) / len(files)
        for i, item, ok in zip(at, files, admitted, strict=True):
            if ok:
                out[i] = True
                state.answers.set(item.key, Presence.LOCAL)
                metrics.write_seconds.labels("nvme").observe(per_chunk)
                metrics.write_bytes.labels("nvme").inc(item.entry.size)
                state.emit(item.key, "nvme", removed=False)
            elif state.cache.contains(item.key):
                out[i] = True  # another process admitted it first
            else:
                metrics.stores_dropped.labels("no_room").inc()  # everything else is pinned
        state.after_removals()
        return out

    def uploaded(self, keys: list[str]) -> None:
        """The uploader PUT these: they are in the object store now."""
        state = self._state
        for key in keys:
            if state.answers.get(key) is not Presence.LOCAL:
                state.answers.set(key, Presence.REMOTE)
            state.emit(key, "object", removed=False)

    def _put_direct(self, fresh: Sequence[tuple[str, memoryview]]) -> list[bool]:
        """No NVMe cache: PUT on the io threads before returning (the caller's buffers are reused next)."""
        state = self._state
        store = state.store
        assert store is not None
        if not state.store_available:
            state.metrics.stores_dropped.labels("store_down").inc(len(fresh))
            return [False] * len(fresh)

        def put(item: tuple[str, memoryview]) -> bool:
            chunk = encode(item[0], item[1], self._codec, element_width=self._width)
            try:
                store.put(item[0], chunk.to_bytes())
            except StoreError as exc:
                state.breaker.failed("put", exc)
                state.metrics.stores_dropped.labels("error").inc()
                return False
            state.metrics.write_bytes.labels("object").inc(chunk.total_length)
            state.answers.set(item[0], Presence.REMOTE)
            state.emit(item[0], "object", removed=False)
            return True

        return state.threads.map(state.threads.io, state.threads.io_workers, put, fresh)
