"""Draining the upload journal: chunks written to NVMe reach the object store, whatever the store does.

The NVMe cache is the write-behind queue (see ``kvstore.cache.index``, ``uploads``): a stored chunk is on
NVMe and in the journal before its store job reports, so nothing is lost when the store is slow, down or
rejecting writes, or when a process dies; the node agent picks up where it, or its predecessor, stopped. One
loop claims a batch (a lease in the index by the node's boot clock: a claim whose holder died is taken over at
once, one whose holder hung expires), PUTs it from the NVMe files on the upload threads, and records the
outcome in one transaction, which also tells the node's engines (the change log). The agent runs at idle
priority, so uploads take only what the engines leave of the CPU and the disk; and with ``hold_s``, while the
engines leave no core idle (`CpuRoom`), uploads wait, no chunk longer than ``hold_s`` after it was stored and
never while a quarter of the cache waits: a burst's uploads come after it, and a node busy for longer uploads
each chunk ``hold_s`` late. Memory for uploads is one chunk per upload thread. A failed PUT opens the breaker
and leaves the chunk in the journal, to be retried after the cooldown; a chunk that left the cache before its
upload is counted once for the node, by the transaction that settles it (``kvstore:uploads_lost`` here, the
index's ``uploads_lost`` node-wide).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable

from kvstore.agent.cpu_room import CpuRoom
from kvstore.cache import Backlog, CachedChunk, NVMeCache
from kvstore.cache.index import CacheIndex
from kvstore.config import DataPathSettings
from kvstore.engine import io
from kvstore.engine.bad_chunks import count_removals, nvme_copy_corrupt
from kvstore.engine.breaker import Breaker
from kvstore.engine.threads import EngineThreads
from kvstore.errors import (
    BucketNotFound,
    CacheClosed,
    CacheError,
    ChunkUnreadable,
    KVStoreError,
    StoreAuthError,
    StoreError,
    StoreUnavailable,
)
from kvstore.metrics import EngineMetrics
from kvstore.stores import ObjectStore

log = logging.getLogger(__name__)

_CLAIM = 64  # chunks per claim: one index transaction claims them, one records them
_LEASE_S = 120.0  # a claim older than this is taken over (its process hung; a dead one's at once)
_IDLE_WAIT_S = 0.5
_UNREADABLE_RETRY_S = 3600.0
_REFUSED_RETRY_S = 300.0  # a chunk the store refused on its own (a 4xx of its own), while the others go on
# The hold with the node's own embedded server: nothing but this node reads its bucket, so a late upload costs
# nothing; the quarter-of-the-cache rule bounds what waits.
OWN_SERVER_HOLD_S = 60.0
# How long each look at the CPUs lasts: /proc/stat counts in 10 ms ticks, 20 per CPU in this window.
_ROOM_WINDOW_S = 0.1


class _Outcome(enum.Enum):
    UPLOADED = "uploaded"
    DEFERRED = "deferred"  # the store failed: retry after the cooldown
    WAITED = "waited"  # not tried: the store failed earlier in the round (retried with the deferred ones)
    GONE = "gone"  # evicted after we claimed it, before we read it
    DAMAGED = "damaged"  # the NVMe copy fails its check: never uploaded
    UNREADABLE = "unreadable"  # written by a newer kvstore on this node: left for an agent that can check it
    REFUSED = "refused"  # the store refused this object alone: retried later, the store stays in use


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
        hold_s: float = 0.0,
        room: CpuRoom | None = None,
    ) -> None:
        """``hold_s``: how long a stored chunk's upload may wait for room on the CPUs (0: never waits)."""
        self._cache = cache
        self._store = store
        self._breaker = breaker
        self._metrics = metrics
        self._threads = threads
        self._cooldown = cooldown_s
        self._hold_ns = int(hold_s * 1e9)
        self._room = room or CpuRoom()
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
                if self._hold_ns:
                    self._wait_for_room()
                    if self._stopping.is_set():
                        return  # no round more once asked to stop
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

    def _wait_for_room(self) -> None:
        """Return once the engines leave a core idle, the oldest waiting chunk has waited ``hold_s``, a
        quarter of the cache waits (more, and eviction would take chunks the bucket does not have yet), or
        nothing waits."""
        while not self._stopping.is_set():
            backlog = self._cache.backlog()
            if (
                not backlog.chunks
                or time.time_ns() - backlog.oldest_queued_ns >= self._hold_ns
                or backlog.bytes * 4 >= self._cache.effective_budget()
            ):
                return
            began = time.monotonic()
            if self._room.has_room(_ROOM_WINDOW_S, self._stopping):
                return
            self._metrics.upload_held_seconds.inc(time.monotonic() - began)

    def _round(self) -> bool:
        if not self._breaker.available():
            return False
        claimed = self._cache.claim_uploads(_CLAIM, lease_s=_LEASE_S)
        if not claimed:
            return False
        outcomes = self._threads.map(self._threads.upload, self._threads.upload_workers, self._one, claimed)
        by_outcome: dict[_Outcome, list[str]] = {o: [] for o in _Outcome}
        for chunk, outcome in zip(claimed, outcomes, strict=True):
            by_outcome[outcome].append(chunk.key)
            if outcome is _Outcome.GONE:
                self._cache.forget(chunk.key, chunk.path)  # an entry naming the vanished file goes too
        if by_outcome[_Outcome.UNREADABLE]:
            self._cache.finish_uploads((), by_outcome[_Outcome.UNREADABLE], retry_in_s=_UNREADABLE_RETRY_S)
        if by_outcome[_Outcome.REFUSED]:
            self._cache.finish_uploads((), by_outcome[_Outcome.REFUSED], retry_in_s=_REFUSED_RETRY_S)
        deferred = by_outcome[_Outcome.DEFERRED] + by_outcome[_Outcome.WAITED]
        # A chunk that left the cache while claimed waited on this upload: the index settles it, uploaded
        # or lost, and counts what is lost once for the node.
        gone = by_outcome[_Outcome.GONE] + by_outcome[_Outcome.DAMAGED]
        self._cache.finish_uploads(
            by_outcome[_Outcome.UPLOADED], deferred, retry_in_s=self._cooldown, gone=gone
        )
        count_removals(self._cache, self._metrics)
        retried = len(by_outcome[_Outcome.DEFERRED]) + len(by_outcome[_Outcome.REFUSED])
        if retried:  # PUTs (or reads) tried and failed, not the chunks that waited behind them
            self._metrics.upload_retries.inc(retried)
        return any(o is _Outcome.UPLOADED for o in outcomes)

    def _one(self, located: CachedChunk) -> _Outcome:
        if not self._breaker.available():
            return _Outcome.WAITED
        start = time.perf_counter()
        try:
            sent = io.upload(self._cache, self._store, located)
        except FileNotFoundError:
            return _Outcome.GONE
        except OSError as exc:  # a failed read proves nothing about the chunk, perhaps its only copy
            log.warning("cannot read queued chunk %s now (%s): it waits for a later round", located.key, exc)
            return _Outcome.DEFERRED
        except ChunkUnreadable as exc:
            log.warning("queued chunk %s is not for this agent (%s): left in the journal", located.key, exc)
            self._metrics.unreadable.labels("nvme").inc()
            return _Outcome.UNREADABLE
        except CacheError as exc:
            nvme_copy_corrupt(self._cache, located.key, str(exc), self._metrics, path=located.path)
            return _Outcome.DAMAGED
        except (StoreUnavailable, StoreAuthError, BucketNotFound) as exc:  # the store as a whole
            self._breaker.failed("put", exc)
            return _Outcome.DEFERRED
        except StoreError as exc:  # this object alone (a 4xx of its own): the rest of the journal goes on
            log.warning("the store refused queued chunk %s (%s): tried again later", located.key, exc)
            self._metrics.store_errors.labels("put").inc()
            return _Outcome.REFUSED
        self._breaker.succeeded()
        self._metrics.write_seconds.labels("object").observe(time.perf_counter() - start)
        self._metrics.write_bytes.labels("object").inc(sent)
        return _Outcome.UPLOADED


def upload_hold_of(settings: DataPathSettings) -> float:
    """The setting `upload_hold_s`, or its default for the node's store."""
    if settings.upload_hold_s is not None:
        return settings.upload_hold_s
    return 0.0 if settings.store_url else OWN_SERVER_HOLD_S


def wait_uploaded(cache: NVMeCache, timeout_s: float) -> bool:
    """Wait until the node's upload journal is empty (whoever uploads it); False on timeout."""
    return _wait_empty(cache.backlog, timeout_s)


def wait_uploaded_in(directory: str | os.PathLike[str], timeout_s: float) -> bool:
    """`wait_uploaded` from outside the node's processes (a benchmark's driver, while its engine and agent
    run): it reads the cache's index alone. Opening the whole cache would also tidy its files and weigh a
    budget it does not know against the disk."""
    index = CacheIndex(directory)
    try:
        return _wait_empty(index.backlog, timeout_s)
    finally:
        index.close()


def _wait_empty(backlog: Callable[[], Backlog], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while backlog().chunks:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
