"""Draining the upload journal: chunks written to NVMe reach the object store, whatever the store does.

The NVMe cache is the write-behind queue (see ``kvstore.cache.index``, ``uploads``): a stored chunk is on
NVMe and in the journal before its store job reports, so nothing is lost when the store is slow, down or
rejecting writes, or when the process dies; the next process to open the cache picks up where this one
stopped. One loop claims a batch (a lease in the index, so the node's processes share the work), PUTs it from
the NVMe files on the upload threads, and records the outcome in one transaction. Uploads yield to the
tier's loads and stores (``activity``): they wait for a quiet moment, and a node that never pauses gets a
trickle of small batches, one a second. Memory for uploads is one chunk per upload thread. A failed PUT opens
the breaker and leaves the chunk in the journal, to be retried after the cooldown; a chunk evicted before its
upload is counted (``kvstore:uploads_lost``).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

from kvstore.cache import CachedChunk, NVMeCache
from kvstore.engine import io
from kvstore.engine.activity import Activity
from kvstore.engine.breaker import Breaker
from kvstore.engine.threads import EngineThreads
from kvstore.errors import CacheClosed, CacheError, KVStoreError, StoreError
from kvstore.metrics import EngineMetrics
from kvstore.stores import ObjectStore

log = logging.getLogger(__name__)

_CLAIM = 64  # chunks per claim: one index transaction claims them, one records them
_CLAIM_BUSY = 8  # ... while the tier's loads and stores keep the node busy: a trickle that always progresses
_LEASE_S = 120.0  # a claim older than this is taken over (its process died, or hung)
_IDLE_WAIT_S = 0.5
_QUIET_S = 0.01
_MAX_YIELD_S = 1.0


class _Outcome(enum.Enum):
    UPLOADED = "uploaded"
    DEFERRED = "deferred"  # the store failed: retry after the cooldown
    GONE = "gone"  # evicted after we claimed it, before we read it
    DAMAGED = "damaged"  # the NVMe copy fails its check: never uploaded


class Uploader:
    def __init__(
        self,
        cache: NVMeCache,
        store: ObjectStore,
        breaker: Breaker,
        metrics: EngineMetrics,
        threads: EngineThreads,
        *,
        activity: Activity,
        cooldown_s: float,
        on_uploaded: Callable[[list[str]], None],
        on_damaged: Callable[[str, str], None],
    ) -> None:
        self._cache = cache
        self._store = store
        self._breaker = breaker
        self._metrics = metrics
        self._threads = threads
        self._activity = activity
        self._cooldown = cooldown_s
        self._on_uploaded = on_uploaded
        self._on_damaged = on_damaged
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._idle = threading.Event()

    def kick(self) -> None:
        """New chunks are in the journal (never blocks)."""
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def wait_drained(self, timeout: float) -> bool:
        """Wait until the journal is empty (every process's part of it); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._cache.backlog().chunks == 0:
                return True
            self.kick()
            time.sleep(0.02)
        return self._cache.backlog().chunks == 0

    def run(self) -> None:
        """The upload loop (one service thread); returns after ``stop``."""
        while not self._stopping.is_set():
            try:
                worked = self._round()
            except CacheClosed:
                return  # shut down under us
            except KVStoreError as exc:  # the index itself failed: try again later, never die
                log.warning("upload round failed: %s", exc)
                worked = False
            except Exception:
                log.exception("upload round failed")
                worked = False
            if not worked:
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()

    def _round(self) -> bool:
        if not self._breaker.available():
            return False
        # Loads and stores first: the journal holds what waits, and a batch goes at least every second.
        quiet = self._activity.wait_quiet(_QUIET_S, _MAX_YIELD_S, self._stopping)
        claimed = self._cache.claim_uploads(_CLAIM if quiet else _CLAIM_BUSY, lease_s=_LEASE_S)
        if not claimed:
            return False
        outcomes = self._threads.map(self._threads.upload, self._threads.upload_workers, self._one, claimed)
        done = [c.key for c, o in zip(claimed, outcomes, strict=True) if o is not _Outcome.DEFERRED]
        deferred = [c.key for c, o in zip(claimed, outcomes, strict=True) if o is _Outcome.DEFERRED]
        # A chunk evicted while claimed was not counted by its eviction: count it here unless it made it.
        evicted = self._cache.finish_uploads(done, deferred, retry_in_s=self._cooldown)
        evicted += [c.key for c, o in zip(claimed, outcomes, strict=True) if o is _Outcome.GONE]
        if evicted:
            self._metrics.uploads_lost.labels("evicted").inc(len(evicted))
        uploaded = [c.key for c, o in zip(claimed, outcomes, strict=True) if o is _Outcome.UPLOADED]
        if uploaded:
            self._on_uploaded(uploaded)
        if deferred:
            self._metrics.upload_retries.inc(len(deferred))
        return bool(uploaded)

    def _one(self, located: CachedChunk) -> _Outcome:
        if not self._breaker.available():
            return _Outcome.DEFERRED
        start = time.perf_counter()
        try:
            sent = io.upload(self._cache, self._store, located)
        except FileNotFoundError:
            return _Outcome.GONE
        except CacheError as exc:
            self._on_damaged(located.key, str(exc))
            return _Outcome.DAMAGED
        except StoreError as exc:
            self._breaker.failed("put", exc)
            return _Outcome.DEFERRED
        self._breaker.succeeded()
        self._metrics.write_seconds.labels("object").observe(time.perf_counter() - start)
        self._metrics.write_bytes.labels("object").inc(sent)
        return _Outcome.UPLOADED
