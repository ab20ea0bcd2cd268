"""`TieredStore`: the node's NVMe cache in front of the shared object store, as one object.

It composes the engine's parts and owns nothing they do not:

=============  ==========================================================================================
``state``      what every path decides with: answers, breaker, events, the rules for a bad chunk
``prober``     probe scheduling for the vLLM scheduler: batched, deduplicated, prefix-ordered, prefetching
``reads``      loads: NVMe (O_DIRECT, verified in place), then prefetched chunks, then object GETs
``writes``     stores: O_DIRECT writes from the caller's buffer, one commit that queues the uploads
``uploader``   drains the upload journal into the object store, whatever the store does
``admission``  object hits to NVMe at a quiet moment
``io``         the I/O itself, as functions that return result records
``threads``    every thread (one place states the thread model)
=============  ==========================================================================================

Every chunk is verified before it is served; a chunk that fails is a miss. Only a chunk proven corrupt in a
format this reader knows is removed; one it cannot read is a miss and is left alone.

Threads: every public method is thread-safe. `lookup_cached`, `needs_probe`, `probe_prefixes`,
`probe_async`, `end_of_step`, `mark_missing`, `touch` and `take_events` never block (the vLLM scheduler calls
them); the others block on I/O and are for the caller's worker threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.cache import NVMeCache
from kvstore.chunk import Codec
from kvstore.engine.activity import Activity
from kvstore.engine.admission import AdmissionQueue
from kvstore.engine.breaker import Breaker
from kvstore.engine.counters import NodeCounters
from kvstore.engine.prefetch import PrefetchBuffer
from kvstore.engine.prober import Prober
from kvstore.engine.probes import AnswerCache, Presence
from kvstore.engine.reads import Reader
from kvstore.engine.state import ChunkEvent, EngineState
from kvstore.engine.threads import EngineThreads
from kvstore.engine.uploader import Uploader
from kvstore.engine.writes import StoreOutcome, Writer
from kvstore.errors import CacheError, ConfigError
from kvstore.metrics import EngineMetrics
from kvstore.stores import ObjectStore

__all__ = ["ChunkEvent", "ShutdownReport", "StoreOutcome", "TieredStore"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShutdownReport:
    not_uploaded: int  # chunks still in the upload journal: the next process on this node uploads them


class TieredStore:
    def __init__(
        self,
        store: ObjectStore | None,
        cache: NVMeCache | None,
        *,
        threads: EngineThreads | None = None,
        codec: Codec = Codec.NONE,
        element_width: int = 2,
        prefetch_bytes: int = 256 << 20,
        probe_hit_ttl_s: float = 600.0,
        probe_miss_ttl_s: float = 2.0,
        outage_cooldown_s: float = 5.0,
        load_timeout_s: float = 5.0,
        metrics: EngineMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if store is None and cache is None:
            raise ConfigError("TieredStore needs an object store, an NVMe cache, or both")
        self.store = store
        self.cache = cache
        self.codec = codec
        self.metrics = metrics or EngineMetrics.for_registry()
        self.threads = threads or EngineThreads()
        # An NVMe answer lives as long as a chunk usually stays; another process may evict it sooner, and a
        # load then falls back to the object store: a stale answer costs time, never a wrong byte.
        answers = AnswerCache(
            local_ttl_s=30.0, remote_ttl_s=probe_hit_ttl_s, miss_ttl_s=probe_miss_ttl_s, clock=clock
        )
        breaker = Breaker(outage_cooldown_s, self.metrics, clock)
        # Loads and stores are foreground; probes count too (a load follows them).
        activity = Activity(also_busy=lambda: self._prober.in_flight > 0)
        self._state = state = EngineState(
            store,
            cache,
            metrics=self.metrics,
            threads=self.threads,
            breaker=breaker,
            answers=answers,
            activity=activity,
            clock=clock,
        )
        self._touches: deque[Sequence[str]] = deque()
        prefetched = PrefetchBuffer(prefetch_bytes, clock=clock)
        self.metrics.prefetch_bytes.set_function(lambda: float(prefetched.held_bytes))
        self._prober = Prober(state, prefetched, on_idle=self._apply_touches)
        self._writer = Writer(state, codec=codec, element_width=element_width)
        self._admission = AdmissionQueue(self._writer.admit_fetched, activity) if cache is not None else None
        self._reader = Reader(
            state,
            prefetched,
            self._admission,
            load_timeout_s=load_timeout_s,
            admit_now=self._writer.admit_fetched,
            touched=self._touches.append,
        )
        self._uploader: Uploader | None = None
        self._counters = NodeCounters(self.metrics, cache) if cache is not None else None
        if cache is not None:
            self.metrics.track_nvme_usage(lambda: _usage_pair(cache))
            self.metrics.track_backlog(lambda: _backlog_triple(cache))
            self.metrics.nvme_direct_io.set(1 if cache.direct_io else 0)
            assert self._admission is not None
            self.threads.service("kvstore-admit", self._admission.run)
            if store is not None:
                self._uploader = Uploader(
                    cache,
                    store,
                    breaker,
                    self.metrics,
                    self.threads,
                    activity=activity,
                    cooldown_s=outage_cooldown_s,
                    on_uploaded=self._writer.uploaded,
                    on_damaged=state.damaged_on_nvme,
                )
                self.threads.service("kvstore-journal", self._uploader.run)
        self.threads.service("kvstore-probe", self._prober.run)

    # ---------------------------------------------------------------- lookup

    def lookup(self, keys: Sequence[str], *, wait: bool = True) -> list[Presence]:
        """Where each chunk can be loaded from, asking the index and (batched) the object store now.

        With `wait=False` unknown keys come back PENDING and are probed in the background. Tools use this;
        the vLLM scheduler uses `lookup_cached`, which never touches LMDB or the network.
        """
        local = self.cache.contains_many(keys) if self.cache is not None else [False] * len(keys)
        out: list[Presence] = []
        unknown: list[int] = []
        usable = self.store_available
        for i, key in enumerate(keys):
            if local[i]:
                out.append(Presence.LOCAL)
                continue
            known = self._state.answers.get(key) if usable else Presence.MISS
            if known in (Presence.REMOTE, Presence.MISS):
                out.append(known)
            else:
                unknown.append(i)
                out.append(Presence.PENDING)
        if unknown:
            batch = [keys[i] for i in unknown]
            if wait:
                for i, present in zip(unknown, self._prober.probe_store(batch), strict=True):
                    out[i] = Presence.REMOTE if present else Presence.MISS
            else:
                self.probe_async(batch)
        for answer in out:
            self._count(answer)
        return out

    def lookup_cached(self, key: str) -> Presence:
        """The scheduler's lookup: memory only, never blocks. PENDING: ask `needs_probe`, then probe."""
        found = self._state.answers.get(key)
        if found is None:
            return Presence.PENDING
        self._prober.answered(key)
        answer = Presence.MISS if found is Presence.REMOTE and not self.store_available else found
        self._count(answer)
        return answer

    def needs_probe(self, key: str) -> bool:
        """Whether a PENDING key must be handed to the probe (a key already asked is not asked again)."""
        return self._prober.needs_probe(key)

    def probe_async(self, keys: Sequence[str]) -> None:
        """Find out where `keys` are, in the background. Never blocks."""
        if keys:
            self._prober.probe_prefixes([[key] for key in keys])

    def probe_prefixes(self, chains: Sequence[Sequence[str]]) -> None:
        """Like `probe_async`, for the unknown keys of requests (one chain each, in token order): see
        `kvstore.engine.prober`. Never blocks."""
        self._prober.probe_prefixes(chains)

    @property
    def probes_in_flight(self) -> int:
        return self._prober.in_flight

    def end_of_step(self) -> None:
        """The scheduler's step is over (see `Prober.end_of_step`)."""
        self._prober.end_of_step()

    def mark_missing(self, key: str) -> None:
        """Remember that `key` could not be loaded, so lookups answer MISS instead of promising it again."""
        self._state.answers.set(key, Presence.MISS)

    def _count(self, answer: Presence) -> None:
        if answer is Presence.PENDING:
            return
        queries, hits = self.metrics.queries, self.metrics.hits
        if self.cache is not None:
            queries.inc("nvme")
            if answer is Presence.LOCAL:
                hits.inc("nvme")
                return
        if self.store is not None:
            queries.inc("object")
            if answer is Presence.REMOTE:
                hits.inc("object")

    # ------------------------------------------------------- loads and stores

    def load_into(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        """Fill each buffer with its chunk's raw bytes; True where the chunk was found and verified.
        Buffers whose entry is False may hold garbage and must not be used."""
        return self._reader.load_into(items)

    def store_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> StoreOutcome:
        """Write chunks to NVMe now, queued for upload. Returns once the caller's buffers may be reused
        (with an NVMe cache, every byte is on disk; without one, it has been PUT)."""
        outcome = self._writer.store_many(items)
        if outcome.written and self._uploader is not None:
            self._uploader.kick()
        return outcome

    def warm(self, keys: Sequence[str], *, cancel: threading.Event | None = None) -> int:
        """Bring ``keys`` from the object store into NVMe now (stopping before the next batch once `cancel`
        is set); how many are on NVMe afterwards."""
        return self._reader.warm(keys, cancel=cancel)

    def get(self, key: str) -> bytes | None:
        """A chunk's raw bytes (verified), or None. For tools; the vLLM path uses `load_into`."""
        return self._reader.get(key)

    # -------------------------------------------------------- health, events

    @property
    def store_available(self) -> bool:
        return self._state.store_available

    def backlog_chunks(self) -> int:
        """Chunks on NVMe waiting for upload (node-wide)."""
        return self.cache.backlog().chunks if self.cache is not None and self.store is not None else 0

    def take_events(self) -> list[ChunkEvent]:
        """Events since the last call (oldest dropped past a bound if nobody takes them)."""
        events = self._state.events
        out: list[ChunkEvent] = []
        while True:
            try:
                out.append(events.popleft())
            except IndexError:
                return out

    def touch(self, keys: Sequence[str]) -> None:
        """Mark chunks used; applied in the background, so the scheduler never waits on the index."""
        if self.cache is not None:
            self._touches.append(keys)

    def _apply_touches(self) -> None:
        """The probe thread's spare time: buffered touches to the index, and the node's counters."""
        if self.cache is None:
            return
        if self._counters is not None:
            self._counters.maybe_publish()
        keys: list[str] = []  # may stay empty: touch() then just writes out buffered touches once due
        while self._touches:
            keys.extend(self._touches.popleft())
        try:
            self.cache.touch(keys)
        except CacheError as exc:
            log.warning("could not record %d touches: %s", len(keys), exc)

    def publish_counters(self) -> None:
        """Add this engine's figures to the node's counters now (they also go every few seconds)."""
        if self._counters is not None:
            self._counters.publish()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the upload journal is empty; False on timeout (or with the store down)."""
        if self._uploader is None:
            return True
        return self.store_available and self._uploader.wait_drained(timeout)

    def close(self, *, flush: bool = True, timeout: float = 30.0) -> ShutdownReport:
        """Stop the engine. With `flush`, waits up to `timeout` for the upload journal to drain; what is left
        stays in the journal, for the next process on this node."""
        if flush:
            self.flush(timeout)
        self._prober.stop()
        if self._uploader is not None:
            self._uploader.stop()
        if self._admission is not None:
            self._admission.close()  # after what is queued: those hits are still written
        self.threads.join(timeout)
        self._apply_touches()
        self.publish_counters()
        left = self.backlog_chunks()
        if left:
            log.info("%d chunks wait in the upload journal for the next start", left)
        return ShutdownReport(not_uploaded=left)


def _usage_pair(cache: NVMeCache) -> tuple[int, int]:
    usage = cache.usage()
    return usage.used_bytes, usage.budget_bytes


def _backlog_triple(cache: NVMeCache) -> tuple[int, int, float]:
    backlog = cache.backlog()
    age = max(0.0, time.time() - backlog.oldest_queued_ns / 1e9) if backlog.oldest_queued_ns else 0.0
    return backlog.chunks, backlog.bytes, age
