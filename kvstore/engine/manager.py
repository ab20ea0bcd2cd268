"""`TieredStore`: the node's NVMe cache in front of the shared object store, as the vLLM process sees it.

It does only what a waiting request needs, and composes the parts that do it:

=============  ==========================================================================================
``outcomes``   what the engine learned: answers, metrics, events, hints for the agent (the one writer)
``prober``     probe scheduling for the vLLM scheduler: batched, deduplicated, prefix-ordered, prefetching
``reads``      loads: NVMe (O_DIRECT, verified in place), then prefetched chunks, then object GETs
``admission``  object hits onto NVMe from the bytes their load verified, at a quiet moment
``writes``     stores: O_DIRECT writes from the caller's buffer, one commit that queues the uploads
``io``         the I/O itself, as functions that return result records
``threads``    every thread (one place states the thread model)
=============  ==========================================================================================

Everything else (uploads, eviction, LRU touches, access records, node counters, pin sync) is the node
agent's (`kvstore.agent`), in a process of its own at idle priority: the
engine tells it what it needs through hints (`kvstore.node.link`) and learns what it did from the node's
change log, both from its housekeeping, which runs in the probe thread's spare time.

Every chunk is verified before it is served; a chunk that fails is a miss. Only a chunk proven corrupt in a
format this reader knows is removed; one it cannot read is a miss and is left alone.

Threads: every public method is thread-safe. `lookup_cached`, `needs_probe`, `probe_prefixes`,
`probe_async`, `end_of_step`, `touch` and `take_events` never block (the vLLM scheduler calls them); the
others block on I/O and are for the caller's worker threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvstore.cache import NVMeCache
from kvstore.chunk import Codec, stored_size
from kvstore.engine.admission import Admission
from kvstore.engine.answers import AnswerCache, Presence
from kvstore.engine.bad_chunks import count_removals
from kvstore.engine.breaker import Breaker
from kvstore.engine.index_writes import IndexWrites
from kvstore.engine.node_counters import NodeCounters
from kvstore.engine.outcomes import ChunkEvent, Outcomes
from kvstore.engine.prefetch import PrefetchBuffer
from kvstore.engine.prober import Prober
from kvstore.engine.reads import Reader
from kvstore.engine.threads import EngineThreads
from kvstore.engine.timeline import Timeline
from kvstore.engine.writes import StoreOutcome, Writer
from kvstore.errors import CacheError
from kvstore.metrics import EngineMetrics
from kvstore.node.engines import register_engine, unregister_engine
from kvstore.node.link import AgentLink
from kvstore.node.watch import AgentWatch
from kvstore.priority import lower_priority
from kvstore.stores import ObjectStore

__all__ = ["ChunkEvent", "ShutdownReport", "StoreOutcome", "TieredStore"]

log = logging.getLogger(__name__)

_CHANGES_PER_READ = 4096
_PENDING, _LOCAL, _MISS = Presence.PENDING, Presence.LOCAL, Presence.MISS
_LAST_HINTS_S = 5.0


@dataclass(frozen=True)
class ShutdownReport:
    not_uploaded: int  # chunks still in the node's upload journal: the node agent uploads them


class TieredStore:
    def __init__(
        self,
        store: ObjectStore | None,
        cache: NVMeCache,
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
        agent: AgentWatch | None = None,
        counters_sink: Callable[[Mapping[str, int]], None] | None = None,
        commit_timeout_s: float = 5.0,
        store_identity: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``agent``: how this engine checks on (and may start) the node agent. ``counters_sink``: where this
        process's figures go for the node's counters; by default to the agent, through the hints (a process
        that hosts the agent writes them to the index itself). ``commit_timeout_s``: how long a store waits
        for the index's write lock (another process may hold it: `kvstore.engine.index_writes`).
        ``store_identity``: the store this engine serves; another on the same cache is refused."""
        self.store = store
        self.cache = cache
        self.codec = codec
        self.metrics = metrics or EngineMetrics.for_registry()
        self.threads = threads or EngineThreads()
        # "On this node" lives as long as "in the bucket": the node's change log tells this engine when a
        # chunk leaves (read a few times a second), and a stale answer costs a load a GET, never a wrong
        # byte. Were it shorter, a conversation back after a pause would wait a probe for chunks it holds.
        answers = AnswerCache(
            local_ttl_s=probe_hit_ttl_s,
            remote_ttl_s=probe_hit_ttl_s,
            miss_ttl_s=probe_miss_ttl_s,
            clock=clock,
        )
        self._answer_entries = answers.entries
        self._clock = clock
        self._looked_up = [0, 0, 0]  # the step's lookup_cached answers: on NVMe, in the bucket, missing
        self._link = AgentLink(cache.directory)
        self._outcomes = Outcomes(
            store,
            cache,
            metrics=self.metrics,
            answers=answers,
            breaker=Breaker(outage_cooldown_s, self.metrics, clock),
            link=self._link,
            index_writes=IndexWrites(commit_timeout_s),
        )
        prefetched = PrefetchBuffer(prefetch_bytes, clock=clock)
        self._prefetch_bytes = prefetch_bytes
        self.metrics.prefetch_bytes.set_function(lambda: float(prefetched.held_bytes))
        self.metrics.track_nvme_usage(lambda: (cache.used_bytes(), cache.budget_bytes))
        self.metrics.track_backlog(lambda: _backlog_triple(cache))
        self.metrics.nvme_direct_io.set(1 if cache.direct_io else 0)
        self._prober = Prober(
            self._outcomes, prefetched, self.threads, clock=clock, on_idle=self.housekeeping
        )
        self._writer = Writer(self._outcomes, self.threads, codec=codec, element_width=element_width)
        self._admission = Admission(
            self._writer.admit_fetched,
            busy=lambda: self._reader.busy or self._prober.in_flight > 0,
            started=lambda: self._reader.started + self._prober.batches_asked,
            budget_bytes=max(prefetch_bytes, 64 << 20),
        )
        self._reader = Reader(
            self._outcomes,
            prefetched,
            self.threads,
            load_timeout_s=load_timeout_s,
            admit=self._admission.offer,
            admitting=self._admission.held,
        )
        self._counters = NodeCounters(self.metrics, counters_sink or self._link.counters)
        self._agent = agent
        self._changes_at = cache.change_seq()
        self._housekeeping_lock = threading.Lock()
        self._marker = register_engine(cache.directory, store_identity)
        self._closed = False
        self.threads.service("kvstore-probe", self._prober.run)
        self.threads.service("kvstore-admit", self._admission.run)

    def expect_chunks(self, payload_bytes: int) -> None:
        """vLLM's chunks carry ``payload_bytes`` of KV: map the memory of a burst of their GET bodies (the
        prefetch budget's worth) in the background, at idle priority, so that a new node's first loads from
        the store write into pages already there instead of faulting in each of them in vLLM's process (see
        `kvstore.stores.buffers`). Compressed chunks vary in length, so only uncompressed ones are known."""
        if self.store is None or self.codec is not Codec.NONE or not self._prefetch_bytes:
            return
        store, length = self.store, stored_size(payload_bytes)

        def reserve() -> None:
            lower_priority()
            # A body at a time, so that closing the engine never waits on more than one.
            for count in range(1, self._prefetch_bytes // length + 1):
                if self._closed:
                    return
                try:
                    if not store.reserve_bodies(length, count):
                        return  # as much is free, or the pool keeps no more
                except (OSError, ValueError) as exc:  # out of memory or address space: the loads fault then
                    log.info("kvstore: GET bodies not reserved ahead: %s", exc)
                    return

        self.threads.service("kvstore-reserve", reserve)

    # ---------------------------------------------------------------- lookup

    def lookup(self, keys: Sequence[str], *, wait: bool = True) -> list[Presence]:
        """Where each chunk can be loaded from, asking the index and (batched) the object store now.

        With `wait=False` unknown keys come back PENDING and are probed in the background. Tools use this;
        the vLLM scheduler uses `lookup_cached`, which never touches LMDB or the network.
        """
        local = self.cache.contains_many(keys)
        out: list[Presence] = []
        unknown: list[int] = []
        usable = self.store_available
        for i, key in enumerate(keys):
            if local[i]:
                out.append(Presence.LOCAL)
                continue
            known = self._outcomes.answer(key) if usable else Presence.MISS
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
        """The scheduler's lookup: the answer cache alone (a dict read). PENDING: not known yet; ask
        `needs_probe`, then probe. It never reads the index: py-lmdb lets go of the GIL around every call, and
        the scheduler thread then waits for it behind whichever thread took it (1.4 ms a read, measured,
        beside one busy Python thread; under a microsecond alone). The probe thread reads the index for a
        whole batch instead, so a chunk on this node that this engine has not seen yet is a hit one step
        later; what this engine stored or loaded it knows at once.

        vLLM asks about every chunk of a waiting request on every step, so this is the hottest call in the
        tier: the answer is read inline, and it is counted in plain integers that the step's end
        (`probe_prefixes` or `end_of_step`, the scheduler's thread too) adds to the metrics, once a step."""
        entry = self._answer_entries.get(key)
        if entry is None:
            return _PENDING
        now = self._clock()
        if now >= entry[1]:
            return _PENDING
        found = entry[0]
        if found is _LOCAL:
            self._looked_up[0] += 1
        elif found is _MISS:
            self._looked_up[2] += 1
        elif self._outcomes.breaker.available_at(now):
            self._looked_up[1] += 1
        else:
            self._looked_up[2] += 1
            return _MISS  # in the bucket, but the store is down: no load may wait on it
        return found

    def needs_probe(self, key: str) -> bool:
        """Whether a PENDING key must be handed to the probe (a key already asked is not asked again)."""
        return self._prober.needs_probe(key)

    def probe_async(self, keys: Sequence[str]) -> None:
        """Find out where `keys` are, in the background. Never blocks."""
        if keys:
            self._prober.probe_prefixes([[key] for key in keys])

    def probe_prefixes(
        self, chains: Sequence[Sequence[str]], *, node_only: Sequence[Sequence[str]] = ()
    ) -> None:
        """Like `probe_async`, for the unknown keys of requests (one chain each, in token order), and
        ``node_only`` chains for this node's index alone (not on NVMe: a miss, the bucket is not asked): see
        `kvstore.engine.prober`. Never blocks. The scheduler calls it at the end of a step."""
        if node_only:
            self._prober.probe_prefixes(node_only, node_only=True)
            self.metrics.tail_probes_on_node.inc(sum(map(len, node_only)))
        self._prober.probe_prefixes(chains)
        self._count_lookups()

    def trace(self, timeline: Timeline | None) -> None:
        """Mark the probe's milestones into ``timeline`` (benchmarks; None: stop)."""
        self._prober.timeline = timeline
        self._admission.timeline = timeline

    @property
    def probes_in_flight(self) -> int:
        return self._prober.in_flight

    def wake_on_answers(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (on the probe's or a load's threads; it must not block) whenever keys have new
        answers: a scheduler idling until its lookups can be answered goes on at once, not at its next
        step."""
        self._outcomes.on_answers = wake

    def end_of_step(self) -> None:
        """The scheduler's step is over (see `Prober.end_of_step`)."""
        self._prober.end_of_step()
        self._count_lookups()

    def _count_lookups(self) -> None:
        """The step's `lookup_cached` answers into the metrics (the scheduler's thread)."""
        local, remote, miss = self._looked_up
        if not local + remote + miss:
            return
        self._looked_up[:] = [0, 0, 0]
        queries, hits = self.metrics.queries, self.metrics.hits
        queries.inc("nvme", local + remote + miss)
        if local:
            hits.inc("nvme", local)
        if self.store is not None and remote + miss:
            queries.inc("object", remote + miss)
            if remote:
                hits.inc("object", remote)

    def _count(self, answer: Presence) -> None:
        if answer is Presence.PENDING:
            return
        queries, hits = self.metrics.queries, self.metrics.hits
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
        Buffers whose entry is False may hold garbage and must not be used; their chunks answer MISS for a
        while (a chunk that fails to load is not promised again at once)."""
        return self._reader.load_into(items)

    def store_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> StoreOutcome:
        """Write chunks to NVMe now, queued for upload. Returns once every byte is on disk, so the caller's
        buffers may be reused."""
        return self._writer.store_many(items)

    # -------------------------------------------------------- health, events

    @property
    def store_available(self) -> bool:
        return self._outcomes.store_available

    def take_events(self) -> list[ChunkEvent]:
        """Events since the last call (oldest dropped past a bound if nobody takes them)."""
        return self._outcomes.take_events()

    def touch(self, keys: Sequence[str]) -> None:
        """Mark chunks used (LRU order, access records for GC): a hint for the node agent. Never blocks."""
        self._link.touched(keys)

    def housekeeping(self) -> None:
        """Hints to the agent, the node's change log into answers and events, counters, the agent's health.
        Runs in the probe thread's spare time (every fraction of a second); callable by tests and tools."""
        with self._housekeeping_lock:
            self._read_changes()
            count_removals(self.cache, self.metrics)
            self._counters.maybe_publish()
            dropped = self._link.dropped
            self._link.send()
            if self._link.dropped > dropped:
                self.metrics.agent_hints_dropped.inc(self._link.dropped - dropped)
            if self._agent is not None:
                self.metrics.agent_up.set(1 if self._agent.check() else 0)

    def publish_counters(self) -> None:
        """Hand this engine's figures for the node's counters over now (they also go every few seconds)."""
        with self._housekeeping_lock:
            self._counters.publish()
            self._link.send()

    def _read_changes(self) -> None:
        try:
            while True:
                changes = self.cache.changes_since(self._changes_at, _CHANGES_PER_READ)
                if not changes:
                    return
                self._outcomes.changed(changes)
                self._changes_at = changes[-1].seq + 1
                if len(changes) < _CHANGES_PER_READ:
                    return
        except CacheError as exc:
            log.debug("could not read the node's change log: %s", exc)

    def close(self) -> ShutdownReport:
        """Stop the engine (idempotent). What waits for upload stays in the journal, for the node agent."""
        if self._closed:
            return ShutdownReport(not_uploaded=0)
        self._closed = True
        self._prober.stop()
        self._admission.close()  # after what is queued: those hits are still written
        self.threads.join(10.0)
        self._counters.publish()
        self.housekeeping()
        if self._link.pending and self._agent is not None and (self._agent.up or self._agent.starting):
            # Its last hints (chunks stored, chunks used) go to an agent that is up or starting.
            self._link.send_within(_LAST_HINTS_S)
        self._link.close()
        self._outcomes.index_writes.close()
        unregister_engine(self._marker)
        try:
            left = self.cache.backlog().chunks if self.store is not None else 0
        except CacheError:
            left = 0
        if left:
            log.info("%d chunks wait in the upload journal for the node agent", left)
        return ShutdownReport(not_uploaded=left)


def _backlog_triple(cache: NVMeCache) -> tuple[int, int, float]:
    backlog = cache.backlog()
    age = max(0.0, time.time() - backlog.oldest_queued_ns / 1e9) if backlog.oldest_queued_ns else 0.0
    return backlog.chunks, backlog.bytes, age
