"""Draining the upload journal: chunks written to NVMe reach the object store, whatever the store does.

The NVMe cache is the write-behind queue (see ``kvstore.cache.index``, ``uploads``): a stored chunk is on
NVMe and in the journal before its store job reports, so nothing is lost when the store is slow, down or
rejecting writes, or when a process dies; the node agent picks up where it, or its predecessor, stopped. One
loop claims a batch (a lease in the index: a claim whose holder died expires), PUTs it from the NVMe files on
the upload threads, and records the outcome in one transaction, which also tells the node's engines (the
change log). The agent runs at idle priority, so uploads take only what the engines leave of the CPU and the
disk. Memory for uploads is one chunk per upload thread. A failed PUT opens the breaker and leaves the chunk
in the journal, to be retried after the cooldown; a chunk evicted before its upload is counted
(``kvstore:uploads_lost``).
"""

from __future__ import annotations

import enum
import logging
import threading
import time

from kvstore.cache import CachedChunk, NVMeCache
from kvstore.engine import io
from kvstore.engine.bad_chunks import nvme_copy_corrupt
from kvstore.engine.breaker import Breaker
from kvstore.engine.threads import EngineThreads
from kvstore.errors import CacheClosed, CacheError, ChunkUnreadable, KVStoreError, StoreError
from kvstore.metrics import EngineMetrics
from kvstore.stores import ObjectStore

log = logging.getLogger(__name__)

_CLAIM = 64  # chunks per claim: one index transaction claims them, one records them
_LEASE_S = 120.0  # a claim older than this is taken over (its process died, or hung)
_IDLE_WAIT_S = 0.5
_UNREADABLE_RETRY_S = 3600.0


class _Outcome(enum.Enum):
    UPLOADED = "uploaded"
    DEFERRED = "deferred"  # the store failed: retry after the cooldown
    GONE = "gone"  # evicted after we claimed it, before we read it
    DAMAGED = "damaged"  # the NVMe copy fails its check: never uploaded
    UNREADABLE = "unreadable"  # written by a newer kvstore on this node: left for an agent that can check it


class Uploader:
    def __init__(
        self,
        cache: NVMeCache,
        store: ObjectStore,
        breaker: Breaker,
        metrics: EngineMetrics,
        threads: EngineThreads,
        *,
        cooldown_s: float,
    ) -> None:
        self._cache = cache
        self._store = store
        self._breaker = breaker
        self._metrics = metrics
        self._threads = threads
        self._cooldown = cooldown_s
        self._wake = threading.Event()
        self._stopping = threading.Event()

    def kick(self) -> None:
        """New chunks may be in the journal (never blocks)."""
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

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
        claimed = self._cache.claim_uploads(_CLAIM, lease_s=_LEASE_S)
        if not claimed:
            return False
        outcomes = self._threads.map(self._threads.upload, self._threads.upload_workers, self._one, claimed)
        kept = (_Outcome.DEFERRED, _Outcome.UNREADABLE)
        done = [c.key for c, o in zip(claimed, outcomes, strict=True) if o not in kept]
        deferred = [c.key for c, o in zip(claimed, outcomes, strict=True) if o is _Outcome.DEFERRED]
        unreadable = [c.key for c, o in zip(claimed, outcomes, strict=True) if o is _Outcome.UNREADABLE]
        if unreadable:
            self._cache.finish_uploads((), unreadable, retry_in_s=_UNREADABLE_RETRY_S)
        # A chunk evicted while claimed was not counted by its eviction: count it here unless it made it.
        evicted = self._cache.finish_uploads(done, deferred, retry_in_s=self._cooldown)
        evicted += [c.key for c, o in zip(claimed, outcomes, strict=True) if o is _Outcome.GONE]
        if evicted:
            self._metrics.uploads_lost.labels("evicted").inc(len(evicted))
        if deferred:
            self._metrics.upload_retries.inc(len(deferred))
        return any(o is _Outcome.UPLOADED for o in outcomes)

    def _one(self, located: CachedChunk) -> _Outcome:
        if not self._breaker.available():
            return _Outcome.DEFERRED
        start = time.perf_counter()
        try:
            sent = io.upload(self._cache, self._store, located)
        except FileNotFoundError:
            return _Outcome.GONE
        except ChunkUnreadable as exc:
            log.warning("queued chunk %s is not for this agent (%s): left in the journal", located.key, exc)
            self._metrics.unreadable.labels("nvme").inc()
            return _Outcome.UNREADABLE
        except CacheError as exc:
            nvme_copy_corrupt(self._cache, located.key, str(exc), self._metrics)
            return _Outcome.DAMAGED
        except StoreError as exc:
            self._breaker.failed("put", exc)
            return _Outcome.DEFERRED
        self._breaker.succeeded()
        self._metrics.write_seconds.labels("object").observe(time.perf_counter() - start)
        self._metrics.write_bytes.labels("object").inc(sent)
        return _Outcome.UPLOADED


def wait_uploaded(cache: NVMeCache, timeout_s: float) -> bool:
    """Wait until the node's upload journal is empty (whoever uploads it); False on timeout."""
    deadline = time.monotonic() + timeout_s
    while cache.backlog().chunks:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
