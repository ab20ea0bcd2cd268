"""`NodeAgent`: the node's background work on one cache directory, run by one process per node.

It owns everything no request waits on, so vLLM's process pays only for the loads and stores a request
needs:

==============  ===========================================================================================
``uploads``     drains the upload journal into the object store (``Uploader``)
``eviction``    keeps the cache below its budget and the disk's free space (``Evictor``)
touches         applies the engines' "used" hints to the LRU order and records them for GC (access records)
counters        adds the engines' figures and its own to the node's counters
pin sync        makes the node's pins follow the bucket's manifests
change log      trims the log the engines read their KV events from
==============  ===========================================================================================

It runs at idle CPU and I/O priority (``kvstore.priority``) in a process of its own (``kvstore
agent``, or started by the first engine on the node), or hosted by another process (the admin service, a
test). Engines reach it through hints (``link``); with it down they keep serving, and the journal waits.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore.access import AccessRecorder
from kvstore.agent.eviction import Evictor
from kvstore.agent.inbox import HintInbox
from kvstore.agent.uploads import Uploader, upload_hold_of
from kvstore.cache import NVMeCache
from kvstore.config import Settings
from kvstore.engine.bad_chunks import count_removals
from kvstore.engine.breaker import Breaker
from kvstore.engine.node_counters import NodeCounters
from kvstore.engine.threads import EngineThreads
from kvstore.errors import CacheClosed, KVStoreError
from kvstore.metrics import EngineMetrics
from kvstore.node.agent_files import HEARTBEAT_S, AgentLock
from kvstore.node.engines import live_engines
from kvstore.node.hints import Hints
from kvstore.pin_sync import PinSyncLoop
from kvstore.priority import lower_priority
from kvstore.stores import ObjectStore

log = logging.getLogger(__name__)

_CHANGES_KEPT = 200_000  # about 30 MB of index; an engine reads the log every fraction of a second
_EVICT_EVERY_S = 0.5
_TRIM_EVERY_S = 30.0
# The node's counters stop growing here, far below the index's 64-bit values: no sum of increments from
# hints, whoever sends them, can overflow one.
_COUNTER_CAP = 1 << 62


class AgentAlreadyRunning(KVStoreError):
    """Another agent holds this cache directory's lock."""


class NodeAgent:
    def __init__(
        self,
        cache: NVMeCache,
        store: ObjectStore | None,
        *,
        metrics: EngineMetrics,
        threads: EngineThreads,
        outage_cooldown_s: float = 5.0,
        upload_hold_s: float = 0.0,
        pin_sync_s: float = 60.0,
        access_flush_s: float = 60.0,
        exit_when_idle_s: float | None = None,
        idle_priority: bool = True,
        publish_counters: bool = True,
        store_identity: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``idle_priority``: lower the agent's threads to SCHED_IDLE and the idle I/O class (in a process of
        its own; a host process whose other threads need the GIL keeps normal priority, or an idle thread
        holding the GIL would stall them). ``publish_counters``: add ``metrics``' growth to the node's
        counters (off when the host process publishes that registry itself). ``exit_when_idle_s``: stop once
        no engine has used the cache that long and nothing waits (an agent an engine started).
        ``store_identity``: the store it serves, in its status file (engines of another store are refused).
        ``upload_hold_s``: how long an upload may wait for the engines to leave a core idle (`Uploader`)."""
        self.cache = cache
        self.store = store
        self.metrics = metrics
        self._threads = threads
        self._cooldown = outage_cooldown_s
        self._upload_hold_s = upload_hold_s
        self._pin_sync_s = pin_sync_s
        self._access_flush_s = access_flush_s
        self._exit_when_idle = exit_when_idle_s
        self._idle_priority = idle_priority
        self._clock = clock
        self._publish_counters = publish_counters
        self._lock = AgentLock(cache.directory, store=store_identity)
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._owns_threads = False
        self.hints_received = 0
        self.failed = False  # whether it stopped on an error, not when asked or idle
        self._failed_hints = 0
        self._rejected_counted = 0  # of hints_rejected, what the metric has
        self._inbox: HintInbox | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self, *, wait_s: float = 10.0) -> None:
        """Become the node's agent and run on a thread of its own; AgentAlreadyRunning if another is."""
        if not self._lock.acquire(wait_s=wait_s):
            raise AgentAlreadyRunning(f"a node agent already runs for {self.cache.directory}")
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="kvstore-agent", daemon=True)
        self._thread.start()
        ready.wait(10.0)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the agent has stopped (by `stop`, or on its own when idle); whether it has."""
        return self._stopped.wait(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop and release the node's lock (idempotent). Work in flight finishes or stays in the journal."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._owns_threads:
            self._threads.join(timeout)

    @classmethod
    def for_settings(
        cls,
        settings: Settings,
        cache: NVMeCache,
        store: ObjectStore | None,
        metrics: EngineMetrics,
        **options: Any,
    ) -> NodeAgent:
        """An agent with the workers, cooldown and pin sync ``settings`` name, and threads of its own (which
        `stop` ends); ``options`` as for the constructor."""
        threads = EngineThreads(
            io_workers=settings.io_workers,
            disk_workers=settings.disk_workers,
            upload_workers=settings.upload_workers,
        )
        agent = cls(
            cache,
            store,
            metrics=metrics,
            threads=threads,
            outage_cooldown_s=settings.outage_cooldown_s,
            upload_hold_s=upload_hold_of(settings),
            pin_sync_s=settings.pin_sync_s,
            **options,
        )
        agent._owns_threads = True
        return agent

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the loop ----------------------------------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        if self._idle_priority:
            lower_priority()  # this thread and every thread it starts: uploads, admission, pools
        work: _Work | None = None
        try:
            work = self._start_work()
            ready.set()
            log.info("node agent running on %s", self.cache.directory)
            self._loop(work)
            work.counters.publish()
        except CacheClosed:
            log.info("node agent: the cache was closed, stopping")
        except Exception:
            self.failed = True
            log.exception("node agent failed")
        finally:
            ready.set()
            if work is not None:
                work.stop()
            with contextlib.suppress(KVStoreError):
                self.cache.flush()
            self._lock.release()
            self._stopped.set()
            log.info("node agent stopped")

    def _start_work(self) -> _Work:
        self._inbox = HintInbox(self.cache.directory)
        work = _Work(
            inbox=self._inbox,
            evictor=Evictor(self.cache, self.metrics, uploading=self.store is not None),
            counters=NodeCounters(
                self.metrics, self.cache.add_counters if self._publish_counters else _ignore
            ),
        )
        if self.store is not None:
            breaker = Breaker(self._cooldown, self.metrics, self._clock)
            work.uploader = Uploader(
                self.cache,
                self.store,
                breaker,
                self.metrics,
                self._threads,
                cooldown_s=self._cooldown,
                hold_s=self._upload_hold_s,
            )
            work.services = [_service("kvstore-uploads", work.uploader.run)]
            work.access = AccessRecorder(self.store, interval_s=self._access_flush_s)
            if self._pin_sync_s:
                work.pin_sync = PinSyncLoop(self.cache, self.store, self._pin_sync_s)
        return work

    def _loop(self, work: _Work) -> None:
        now = self._clock()
        beat_at = evict_at = trim_at = now
        idle_since: float | None = None
        while not self._stopping.is_set():
            self._take_all(work.inbox.receive(timeout=min(HEARTBEAT_S, _EVICT_EVERY_S)), work)
            now = self._clock()
            if now >= beat_at:
                beat_at = now + HEARTBEAT_S
                with _carrying_on("the heartbeat's work"):
                    self._lock.heartbeat()
                    work.counters.maybe_publish()
                    count_removals(self.cache, self.metrics)
                    if self._exit_when_idle is not None:
                        idle_since = self._idle_since(idle_since, now, work)
                if self._idle_long_enough(idle_since, now):
                    break
            if now >= evict_at:
                work.evictor.check()
                evict_at = now + _EVICT_EVERY_S
            if now >= trim_at:
                trim_at = now + _TRIM_EVERY_S
                with _carrying_on("trimming the change log"):
                    self.cache.trim_changes(_CHANGES_KEPT)
        self._take_all(work.inbox.receive(timeout=0.05), work)  # stopping: engines' last word still counts

    @property
    def hints_rejected(self) -> int:
        """Datagrams refused in whole or in part (not hints, keys the index cannot hold, unknown counters)."""
        inbox = self._inbox
        return self._failed_hints + (inbox.rejected if inbox is not None else 0)

    def _take_all(self, received: list[Hints], work: _Work) -> None:
        counters: dict[str, int] = {}
        for hints in received:
            try:
                self._take(hints, work)
            except CacheClosed:
                raise
            except Exception as exc:  # whatever a hint holds, the agent goes on
                self._failed_hints += 1
                log.warning("a hint from pid %s was dropped: %s", hints.pid, exc)
            for name, delta in hints.counters.items():
                counters[name] = counters.get(name, 0) + delta
        if counters:
            self._add_counters(counters)
        rejected = self.hints_rejected
        if rejected > self._rejected_counted:
            self.metrics.agent_hints_rejected.inc(rejected - self._rejected_counted)
            self._rejected_counted = rejected

    def _add_counters(self, increments: Mapping[str, int]) -> None:
        """The engines' increments, in one transaction; each counter stops at ``_COUNTER_CAP``."""
        try:
            totals = self.cache.counters()
            capped = {k: min(v, max(0, _COUNTER_CAP - totals.get(k, 0))) for k, v in increments.items()}
            self.cache.add_counters(capped)
        except CacheClosed:
            raise
        except KVStoreError as exc:  # figures only
            log.debug("could not add the engines' counters: %s", exc)

    def _take(self, hints: Hints, work: _Work) -> None:
        self.hints_received += 1
        if work.access is not None:
            work.access.record(hints.touched)
            work.access.record(hints.stored)
        if hints.stored and work.uploader is not None:
            work.uploader.kick()
        if hints.touched:  # last: an index error here costs the touches alone
            self.cache.touch(hints.touched)

    def _idle_long_enough(self, idle_since: float | None, now: float) -> bool:
        """Whether no engine has used the cache for ``exit_when_idle_s`` (said in the log when so)."""
        limit = self._exit_when_idle
        if limit is None or idle_since is None or now - idle_since < limit:
            return False
        log.info("no engine has used %s for %.0f s: exiting", self.cache.directory, now - idle_since)
        return True

    def _idle_since(self, since: float | None, now: float, work: _Work) -> float | None:
        busy = bool(live_engines(self.cache.directory)) or self.cache.backlog().chunks > 0
        if busy:
            return None
        return now if since is None else since


@contextlib.contextmanager
def _carrying_on(what: str) -> Iterator[None]:
    """The agent's periodic work outlives an index or disk error (LMDB reports a full disk as EIO): the
    error is logged and the work tried again at its next turn. A closed cache still ends the loop."""
    try:
        yield
    except CacheClosed:
        raise
    except (KVStoreError, OSError) as exc:
        log.warning("node agent: %s failed, tried again at its next turn: %s", what, exc)


@dataclass
class _Work:
    """The parts of a running agent."""

    inbox: HintInbox
    evictor: Evictor
    counters: NodeCounters
    uploader: Uploader | None = None
    access: AccessRecorder | None = None
    pin_sync: PinSyncLoop | None = None
    services: list[threading.Thread] = field(default_factory=list)

    def stop(self) -> None:
        if self.uploader is not None:
            self.uploader.stop()
        for thread in self.services:
            thread.join(30.0)
        if self.pin_sync is not None:
            self.pin_sync.stop()
        if self.access is not None:
            self.access.close()
        self.inbox.close()


def _ignore(deltas: Mapping[str, int]) -> None:
    pass


def _service(name: str, loop: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread
