"""The read path: chunks into the caller's buffers, verified, from the fastest tier that has them.

NVMe (the index says present) -> O_DIRECT reads on the disk threads, in parallel (cold reads need queue
depth), verified in place; then what the probe already fetched (verified when it arrived) -> copied in at
memory speed; then object GETs on the io threads, within the load deadline -> verified while copied. Object
hits go to NVMe afterwards, at a quiet moment (``admission``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvstore.cache import CachedChunk, ReadResult, ReadStatus
from kvstore.engine import io
from kvstore.engine.admission import AdmissionQueue
from kvstore.engine.io import Fetched
from kvstore.engine.prefetch import PrefetchBuffer
from kvstore.engine.state import EngineState
from kvstore.errors import ConfigError, StoreError, StoreUnavailable

log = logging.getLogger(__name__)

_WARM_BATCH = 64  # chunks a warm holds in memory at once


class Reader:
    def __init__(
        self,
        state: EngineState,
        prefetched: PrefetchBuffer,
        admission: AdmissionQueue | None,
        *,
        load_timeout_s: float,
        admit_now: Callable[[list[Fetched]], None],
        touched: Callable[[Sequence[str]], None],
    ) -> None:
        self._state = state
        self._prefetched = prefetched
        self._admission = admission
        self._load_timeout = load_timeout_s
        self._admit_now = admit_now
        self._touched = touched

    def load_into(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        """Fill each buffer with its chunk's raw bytes; True where the chunk was found and verified.
        Buffers whose entry is False may hold garbage and must not be used."""
        with self._state.activity.foreground():
            return self._load_into(items)

    def _load_into(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        state = self._state
        out = self._load_local(items) if state.cache is not None else [False] * len(items)
        missing = [i for i, ok in enumerate(out) if not ok]
        if state.store is None or not missing:
            return out
        # What the probe already fetched is in memory and verified: copy it here, at memory speed. Only the
        # rest waits on the network, and on the io workers, which may still be busy with that probe's GETs.
        hits: list[Fetched] = []
        on_network: list[int] = []
        for i in missing:
            key, dest = items[i]
            held = self._prefetched.take(key)
            if held is None:
                on_network.append(i)
                continue
            failure = io.deliver(held, dest)
            if failure is None:
                out[i] = True
                hits.append(held)
            else:
                state.object_miss(Fetched(key, held.blob, held.region, error=failure))
        if on_network and state.store_available:
            for i, fetched in zip(on_network, self._fetch_all([items[i] for i in on_network]), strict=True):
                if fetched is not None and fetched.good:
                    out[i] = True
                    hits.append(fetched)
                elif fetched is not None:
                    state.object_miss(fetched)
        if hits:
            state.object_hits(hits)
            if self._admission is not None:
                self._admission.offer(hits)  # one background batch: one index commit, off the critical path
        return out

    def _load_local(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        state = self._state
        cache = state.cache
        assert cache is not None
        start = time.perf_counter()
        # One index read for the whole batch: each LMDB transaction hands the GIL away once.
        located = cache.locate_many([key for key, _ in items])
        here = [i for i, loc in enumerate(located) if loc is not None]
        out = [False] * len(items)
        if not here:
            return out

        def read(i: int) -> ReadResult:
            loc = located[i]
            assert loc is not None
            return cache.read_into(loc, items[i][1])

        results = state.threads.map(state.threads.disk, state.threads.disk_workers, read, here)
        nbytes = 0
        for i, result in zip(here, results, strict=True):
            loc = located[i]
            assert loc is not None
            out[i] = self._accept_local(loc, result)
            nbytes += loc.raw_length if out[i] else 0
        hits = [items[i][0] for i in here if out[i]]
        if hits:
            self._touched(hits)
            per_chunk = (time.perf_counter() - start) / len(here)
            seconds = state.metrics.read_seconds.labels("nvme")
            for _ in hits:
                seconds.observe(per_chunk)
            state.metrics.read_bytes.labels("nvme").inc(nbytes)
        return out

    def _accept_local(self, located: CachedChunk, result: ReadResult) -> bool:
        state = self._state
        assert state.cache is not None
        key, status = located.key, result.status
        if status is ReadStatus.OK:
            return True
        if status is ReadStatus.GONE:
            # Evicted by another process after our index read, or lost: forget it if it is still indexed.
            state.cache.forget(key, located.path)
            state.answers.forget(key)
        elif status is ReadStatus.CORRUPT:
            state.damaged_on_nvme(key, result.detail)
        elif status is ReadStatus.UNREADABLE:
            log.info("NVMe chunk %s is not for this reader: %s", key, result.detail)
            state.metrics.unreadable.labels("nvme").inc()
        else:
            log.warning("NVMe read of %s failed: %s", key, result.detail)
            state.metrics.load_failures.labels("nvme").inc()
        return False

    def _fetch_all(self, items: Sequence[tuple[str, memoryview]]) -> list[Fetched | None]:
        """GET each chunk into its buffer on the io threads, within the load deadline; None where no
        answer came in time (the breaker then opens: a store that slow is not worth waiting for)."""
        state = self._state
        assert state.store is not None
        batch = io.NetworkBatch(state.store, items)
        deadline = time.monotonic() + self._load_timeout
        results, errors = batch.run(state.threads.io.submit, state.threads.io_workers, deadline)
        failure = next((e for e in errors if e is not None), None)
        if failure is not None:
            state.breaker.failed("get", failure)
        elif any(r is None for r in results):
            state.breaker.failed("get", StoreUnavailable(f"no answer within {self._load_timeout:.1f} s"))
        else:
            state.breaker.succeeded()
        timed_out = sum(result is None for result in results)
        if timed_out:
            state.metrics.load_failures.labels("object").inc(timed_out)
        return results

    def get(self, key: str) -> bytes | None:
        """A chunk's raw bytes (verified), or None. For tools; the vLLM path uses `load_into`."""
        state = self._state
        if state.cache is not None:
            raw = state.cache.get(key)
            state.after_removals()
            if raw is not None:
                return raw
        if state.store is None or not state.store_available:
            return None
        try:
            fetched = io.fetch(state.store, key)
        except StoreError as exc:
            state.breaker.failed("get", exc)
            return None
        if not fetched.good:
            state.object_miss(fetched, loading=False)
            return None
        assert fetched.header is not None
        out = bytearray(fetched.header.raw_length)
        if io.deliver(fetched, memoryview(out)) is not None:
            return None
        state.object_hits([fetched])
        return bytes(out)

    def warm(self, keys: Sequence[str], *, cancel: threading.Event | None = None) -> int:
        """Bring ``keys`` from the object store into NVMe now, through the one admission path; how many are
        on NVMe afterwards."""
        state = self._state
        if state.cache is None:
            raise ConfigError("warming needs an engine with an NVMe cache")
        if not keys:
            return 0
        cached = state.cache.contains_many(keys)
        wanted = [k for k, here in zip(keys, cached, strict=True) if not here]
        store = state.store
        for start in range(0, len(wanted), _WARM_BATCH):
            if store is None or not state.store_available or (cancel is not None and cancel.is_set()):
                break
            try:
                fetched = state.threads.map(
                    state.threads.io,
                    state.threads.io_workers,
                    lambda k: io.fetch(store, k),
                    wanted[start : start + _WARM_BATCH],
                )
            except StoreError as exc:
                state.breaker.failed("get", exc)
                break
            for miss in (f for f in fetched if not f.good):
                state.object_miss(miss, loading=False)
            good = [f for f in fetched if f.good]
            if good:
                self._admit_now(good)
        return sum(state.cache.contains_many(keys))
