"""Probe scheduling: finding out, in the background, where the chunks the scheduler asked about are.

The vLLM scheduler must never block, so its lookups read only the answer cache; what it does not know goes
to the probe, one thread that asks the index first and answers what is on this node at once, then hands the
rest to the object store on the io threads without waiting (by GET when prefetching is on, so the load that
follows finds the bytes in memory, see `kvstore.engine.chain_fetch`; else by HEAD): a request whose chunks
are on NVMe never waits behind another request's GETs. A request that waits looks its keys up again on every
scheduler step: a key already asked is not asked again until it is answered, every probe has ended, or it
was asked longer ago than ``_ASK_AGAIN_S`` (its answer may have been lost to a store error).

Some chains are asked of this node alone (`probe_prefixes(..., node_only=True)`): the index answers them and
what is not on NVMe is a miss, with no request to the bucket. The scheduler does this for the short tail of a
request whose beginning this node holds, the new turn of a conversation, when the operator asks for it
(`probe_tail_tokens`): on a node that serves its conversations alone it is never in the bucket.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from kvstore.engine.chain_fetch import ChainFetch
from kvstore.engine.outcomes import Outcomes
from kvstore.engine.prefetch import PrefetchBuffer
from kvstore.engine.threads import EngineThreads
from kvstore.engine.timeline import INDEX_READ, PROBE_STARTED, Timeline
from kvstore.errors import StoreError

log = logging.getLogger(__name__)

_MAX_PENDING_PROBES = 65_536
_ASK_AGAIN_S = 1.0
_IDLE_S = 0.2


class Prober:
    def __init__(
        self,
        outcomes: Outcomes,
        prefetched: PrefetchBuffer,
        threads: EngineThreads,
        *,
        clock: Callable[[], float],
        on_idle: Callable[[], None],
    ) -> None:
        self._outcomes = outcomes
        self._prefetched = prefetched
        self._threads = threads
        self._clock = clock
        self._on_idle = on_idle  # the probe thread's spare time: the engine's housekeeping
        self._asked: dict[str, float] = {}  # keys handed to the probe and not answered yet
        self._requests: queue.SimpleQueue[list[list[str]]] = queue.SimpleQueue()
        self._probing: set[str] = set()  # keys the probe is answering now (the index, or GETs in flight)
        self.batches_asked = 0  # batches of chains queued so far
        self._node_only: set[str] = set()  # keys asked of this node alone (answered by the index)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.timeline: Timeline | None = None  # milestones for benchmarks (see `kvstore.engine.timeline`)

    # -- the scheduler's side (never blocks) -------------------------------------------------------------

    def needs_probe(self, key: str) -> bool:
        """Whether a key the answers do not know must be handed to the probe (see the module docstring)."""
        asked = self._asked.get(key)
        return asked is None or self._clock() - asked > _ASK_AGAIN_S

    def probe_prefixes(self, chains: Sequence[Sequence[str]], *, node_only: bool = False) -> None:
        """Queue chains of keys for the probe. A chain is the unknown keys of one request (and KV-cache
        group) in token order: a request can only use the chunks before its first miss, so when probing by
        GET the first key of every chain is asked first, and a chain stops at its first miss (the keys after
        it stay unanswered, asked again if anyone still wants them). With ``node_only``, only the index is
        asked (see the module docstring); a key also asked without it is asked of the bucket too."""
        lists = [list(chain) for chain in chains if chain]
        if lists:
            now = self._clock()
            keys = [key for chain in lists for key in chain]
            self._asked.update((key, now) for key in keys)
            if node_only:
                with self._lock:
                    if len(self._node_only) > _MAX_PENDING_PROBES:  # keys answered by another probe first
                        self._node_only.clear()
                    self._node_only.update(keys)
            elif self._node_only:  # only this thread adds to it: empty now, nothing to take back
                with self._lock:
                    self._node_only.difference_update(keys)
            self.batches_asked += 1
            self._requests.put(lists)

    @property
    def in_flight(self) -> int:
        return len(self._probing) + self._requests.qsize()

    def end_of_step(self) -> None:
        """Once every probe has ended, what is still unanswered may be asked again."""
        if self._asked and not self.in_flight:
            self._asked.clear()

    # -- the probe thread --------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stopping.set()
        self._requests.put([])  # wakes the thread now rather than at its next idle tick

    def run(self) -> None:
        """The probe thread: answers what the index knows at once, and hands the rest to the object store
        without waiting for it, so a batch of NVMe hits never queues behind another batch's GETs."""
        while not self._stopping.is_set():
            try:
                chains = self._requests.get(timeout=_IDLE_S)
            except queue.Empty:
                self._on_idle()
                continue
            if not chains:  # `stop`'s wake-up (probe_prefixes never queues an empty list)
                continue
            pending = sum(map(len, chains))
            while pending < _MAX_PENDING_PROBES:
                try:
                    more = self._requests.get_nowait()
                except queue.Empty:
                    break
                chains.extend(more)
                pending += sum(map(len, more))
            with self._lock:
                chains = self._unanswered(chains)
                self._probing.update(key for chain in chains for key in chain)
            if self.timeline is not None:
                self.timeline.mark(PROBE_STARTED)
            try:
                self._answer(chains)
            except Exception:  # a probe must never kill the thread; unanswered keys are asked again
                log.exception("probe of %d chunks failed", sum(map(len, chains)))
                self._done([key for chain in chains for key in chain])
            self._on_idle()

    def probe_store(self, keys: Sequence[str]) -> list[bool]:
        """Ask the object store now (HEADs) whether ``keys`` exist; the answers are recorded."""
        outcomes = self._outcomes
        if outcomes.store is None or not outcomes.store_available:
            return [False] * len(keys)
        try:
            found = outcomes.store.exists_many(keys)
        except StoreError as exc:
            outcomes.breaker.failed("exists", exc)
            return [False] * len(keys)
        outcomes.breaker.succeeded()
        outcomes.in_bucket([key for key, present in zip(keys, found, strict=True) if present])
        outcomes.nowhere([key for key, present in zip(keys, found, strict=True) if not present])
        return found

    def _unanswered(self, chains: list[list[str]]) -> list[list[str]]:
        """The chains with answered keys and keys still being probed left out, each key in one chain only
        (its first). Under the lock."""
        seen: set[str] = set()
        out: list[list[str]] = []
        answer = self._outcomes.answer
        for chain in chains:
            left = [
                k
                for k in dict.fromkeys(chain)
                if k not in seen and k not in self._probing and answer(k) is None
            ]
            seen.update(left)
            if left:
                out.append(left)
        return out

    def _answer(self, chains: list[list[str]]) -> None:
        outcomes = self._outcomes
        keys = [key for chain in chains for key in chain]
        here = outcomes.cache.contains_many(keys)
        if self.timeline is not None:
            self.timeline.mark(INDEX_READ)
        local = [key for key, cached in zip(keys, here, strict=True) if cached]
        outcomes.on_nvme(local)
        on_node = set(local)
        self._done(local)
        elsewhere = [chain for chain in ([k for k in c if k not in on_node] for c in chains) if chain]
        # Node-only keys are added before their chain is queued: an empty set here means none in this batch.
        if self._node_only:
            with self._lock:
                node_only = {k for chain in elsewhere for k in chain if k in self._node_only}
                self._node_only -= node_only
            if node_only:  # not on this node, and not to be asked of the bucket: a miss
                outcomes.nowhere(list(node_only))
                self._done(list(node_only))
                kept = ([k for k in chain if k not in node_only] for chain in elsewhere)
                elsewhere = [chain for chain in kept if chain]
        if not elsewhere:
            return
        rest = [key for chain in elsewhere for key in chain]
        threads = self._threads
        if not outcomes.store_available:
            outcomes.nowhere(rest)
            self._done(rest)
        elif self._prefetched.enabled:
            fetch = ChainFetch(
                elsewhere,
                outcomes,
                self._prefetched,
                on_done=self._fetched,
                stopping=self._stopping,
                timeline=self.timeline,
            )
            fetch.start(threads.io.submit, threads.io_workers)
        else:
            threads.io.submit(self._heads, rest)

    def _heads(self, keys: list[str]) -> None:
        try:
            self.probe_store(keys)
        finally:
            self._done(keys)

    def _fetched(self, fetch: ChainFetch) -> None:
        """A batch's GETs have all ended (on its last io thread)."""
        if fetch.error is not None:  # keys answered before the failure stand; the rest are asked again
            self._outcomes.breaker.failed("get", fetch.error)
        else:
            self._outcomes.breaker.succeeded()
        self._done(fetch.keys)

    def _done(self, keys: Sequence[str]) -> None:
        """These keys are answered, or will be asked again: no longer in flight."""
        with self._lock:
            for key in keys:
                self._probing.discard(key)
                self._asked.pop(key, None)
