"""What the engine learned about chunks, recorded in one place.

The probe, the loads and the stores each do their own I/O and report what they found here; `Outcomes` alone
turns that into the answers the scheduler's lookups read, the metrics, the KV events, and the hints the node
agent acts on (chunks stored, chunks used). Nothing else writes the answer cache, so one file says
when a chunk is believed to be on this node, in the bucket, or nowhere:

================  ==================================================================================
on this node      the probe found it in the index, or a store admitted it
in the bucket     the probe's GET or HEAD found it, a load served it, or the node's change log says
                  its upload finished
nowhere           the probe found nothing, or a load could not get it (a chunk that fails to load is
                  never promised again until its short "missing" answer expires)
forgotten         the change log says it left this node (evicted, removed), or its file was gone
================  ==================================================================================

A bad chunk follows `bad_chunks`' rule whoever meets it.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.cache import Change, ChangeKind, NVMeCache
from kvstore.engine.answers import AnswerCache, Presence
from kvstore.engine.bad_chunks import nvme_copy_corrupt, object_not_usable
from kvstore.engine.breaker import Breaker
from kvstore.engine.index_writes import IndexWrites
from kvstore.engine.io import Fetched
from kvstore.metrics import EngineMetrics
from kvstore.node.link import AgentLink
from kvstore.stores import ObjectStore

log = logging.getLogger(__name__)

_MAX_EVENTS = 65_536


@dataclass(frozen=True)
class ChunkEvent:
    """A chunk became available in, or left, a tier (the vLLM tier turns these into KV events)."""

    key: str
    tier: str  # "nvme" | "object"
    removed: bool
    last_copy: bool = False  # a removal that leaves no copy anywhere (its upload never finished)


class Outcomes:
    def __init__(
        self,
        store: ObjectStore | None,
        cache: NVMeCache,
        *,
        metrics: EngineMetrics,
        answers: AnswerCache,
        breaker: Breaker,
        link: AgentLink | None,
        index_writes: IndexWrites | None = None,
    ) -> None:
        """``index_writes``: where this engine's writes to the index run, each with a deadline."""
        self.store = store
        self.cache = cache
        self.metrics = metrics
        self.breaker = breaker
        self.index_writes = index_writes or IndexWrites()
        self._answers = answers
        self._link = link
        self._events: deque[ChunkEvent] = deque(maxlen=_MAX_EVENTS)
        # Called once keys have answers (on the probe's threads, or a load's): a scheduler idling until it
        # knows more can go on at once rather than at its next step.
        self.on_answers: Callable[[], None] = _nothing

    # -- reads of the state (the scheduler's thread among others) ----------------------------------------

    def answer(self, key: str) -> Presence | None:
        """What is believed about ``key`` (None: nothing, or it expired). Never blocks."""
        return self._answers.get(key)

    @property
    def store_available(self) -> bool:
        return self.store is not None and self.breaker.available()

    def take_events(self) -> list[ChunkEvent]:
        out: list[ChunkEvent] = []
        with contextlib.suppress(IndexError):
            while True:
                out.append(self._events.popleft())
        return out

    # -- what the probe found ----------------------------------------------------------------------------

    def on_nvme(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._answers.set(key, Presence.LOCAL)
        if keys:
            self.on_answers()

    def in_bucket(self, keys: Sequence[str]) -> None:
        self._remote(keys)
        if keys:
            self.on_answers()

    def nowhere(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._answers.set(key, Presence.MISS)
        if keys:
            self.on_answers()

    def not_usable(self, fetched: Fetched, *, loading: bool) -> None:
        """A GET that found no usable chunk. During a load, a chunk the probe had promised is a failure."""
        assert self.store is not None
        if object_not_usable(self.store, fetched, self.metrics):
            self._events.append(ChunkEvent(fetched.key, "object", removed=True))
        elif fetched.error is None and loading:  # promised by a probe, gone by the load (GC, a region down)
            self.metrics.load_failures.labels("object").inc()
        # Last: whoever reads this answer finds the judgement done (the bad object gone, counted).
        self._answers.set(fetched.key, Presence.MISS)
        self.on_answers()

    # -- loads -------------------------------------------------------------------------------------------

    def loaded_from_nvme(self, keys: Sequence[str], nbytes: int, seconds_each: float) -> None:
        seconds = self.metrics.read_seconds.labels("nvme")
        for _ in keys:
            seconds.observe(seconds_each)
        self.metrics.read_bytes.labels("nvme").inc(nbytes)
        if self._link is not None:
            self._link.touched(keys)

    def loaded_from_bucket(self, hits: Sequence[Fetched]) -> None:
        """Verified object-store chunks served: metrics, regions, answers, and the agent told they were
        used (access records). Their NVMe admission is the engine's (`kvstore.engine.admission`)."""
        seconds = self.metrics.read_seconds.labels("object")
        nbytes = 0
        for hit in hits:
            assert hit.header is not None
            seconds.observe(hit.seconds)
            nbytes += hit.header.raw_length
            if hit.region is not None:  # several regions: which one served it
                self.metrics.region_hits.labels(hit.region).inc()
        self.metrics.read_bytes.labels("object").inc(nbytes)
        keys = [hit.key for hit in hits]
        self.in_bucket(keys)
        if self._link is not None:
            self._link.touched(keys)

    def load_failed(self, keys: Sequence[str]) -> None:
        """Chunks a load could not deliver: never promised again until the "missing" answer expires, so the
        scheduler cannot livelock on them."""
        self.nowhere(keys)

    def nvme_file_gone(self, key: str, path: str) -> None:
        """Evicted by another process after our index read, or lost: drop the entry if it still names that
        file (the change log then says so to every engine). Past the index's deadline the entry stays: the
        next reader finds the file gone again."""
        self.index_writes.run(lambda: self.cache.forget(key, path))
        self._answers.forget(key)

    def nvme_copy_corrupt(self, key: str, why: str) -> None:
        self.index_writes.run(lambda: nvme_copy_corrupt(self.cache, key, why, self.metrics))
        self._answers.forget(key)

    # -- stores ------------------------------------------------------------------------------------------

    def stored(self, keys: Sequence[str], sizes: Sequence[int], seconds_each: float) -> None:
        """Chunks admitted to NVMe by this engine (queued for upload when there is a store)."""
        seconds = self.metrics.write_seconds.labels("nvme")
        for key in keys:
            self._answers.set(key, Presence.LOCAL)
            seconds.observe(seconds_each)
            self._events.append(ChunkEvent(key, "nvme", removed=False))
        self.metrics.write_bytes.labels("nvme").inc(sum(sizes))
        if self._link is not None:
            self._link.stored(keys)  # access records: GC sees a chunk as used from its store on

    # -- the node's change log ---------------------------------------------------------------------------

    def changed(self, changes: Sequence[Change]) -> None:
        """What any process on the node did to chunks: evictions and removals leave this node, finished
        uploads reach the bucket."""
        for change in changes:
            if change.kind is ChangeKind.UPLOADED:  # news, not an answer anyone waits for
                self._remote([change.key])
                self._events.append(ChunkEvent(change.key, "object", removed=False))
            else:
                self._answers.forget(change.key)
                self._events.append(ChunkEvent(change.key, "nvme", True, last_copy=not change.uploaded))

    def _remote(self, keys: Sequence[str]) -> None:
        for key in keys:
            if self._answers.get(key) is not Presence.LOCAL:  # the node's own copy is the better answer
                self._answers.set(key, Presence.REMOTE)


def _nothing() -> None:
    pass
