"""The probe's GETs for one batch of chains, on the io threads, without the probe thread waiting for them.

Each chain is the unknown keys of one request (and KV-cache group) in token order, and a request can use only
the chunks before its first miss. So keys are asked rank by rank over the chains (every chain's first key,
then every second key...), nothing past a chain's known miss is fetched, and each hit is verified as it
arrives and held for its load (`PrefetchBuffer`).

Where the store keeps many GETs in flight, a chain's other keys wait for its first key's answer: a context
the bucket never saw (every new conversation's first turn) then costs one GET, not one per chunk, each a 404
the turn waits for (241-258 GETs per `bench multiturn` point, its first turns held 42-54 ms). A chain whose
first key is found goes on at once, whatever the other chains' GETs are still waiting for, and without
waiting for that key's bytes: the answer's head says it exists. A body comes at one connection's rate (S3's
is about 100 MB/s, 20 ms for a 2 MiB chunk): through a link of 10 ms and 100 MB/s per connection (`kvstore
bench tiers --bucket-rtt-ms 10 --bucket-mb-s 100`), a new node loaded 2 MiB chunks at 0.47-0.50 GB/s against
0.43-0.45 waiting for the body (three runs each, 2026-12-07); on loopback, no difference.

Answers are published in waves, per chain: when the chain's contiguous prefix of hits has grown by a quarter
of the chain (at least ``_MIN_WAVE`` keys) or has reached its end (the last key, or the first miss). Each
publication becomes one promotion job at vLLM's next step; per GET, a request of 47 chunks made 14-21 jobs,
each with its own round of GIL hand-offs on vLLM's threads, while the GETs it waited for still ran.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Callable

from kvstore.engine import io
from kvstore.engine.outcomes import Outcomes
from kvstore.engine.prefetch import PrefetchBuffer
from kvstore.engine.timeline import GET_RETURNED, Timeline
from kvstore.errors import StoreError
from kvstore.stores import ObjectStore

log = logging.getLogger(__name__)

_MIN_WAVE = 8


class ChainFetch:
    """GETs of one batch of chains; ``start`` returns at once, ``on_done`` runs once they have all ended."""

    def __init__(
        self,
        chains: list[list[str]],
        outcomes: Outcomes,
        prefetched: PrefetchBuffer,
        *,
        on_done: Callable[[ChainFetch], None],
        stopping: threading.Event,
        timeline: Timeline | None = None,
    ) -> None:
        """``on_done`` runs on the last runner once every GET has ended; ``stopping`` ends the batch early
        (the engine closes: what is not fetched yet stays unanswered)."""
        self.chains = chains
        self._stopping = stopping
        self._outcomes = outcomes
        self._prefetched = prefetched
        self._on_done = on_done
        self._timeline = timeline
        self._ready = [(0, c) for c in range(len(chains))]  # (rank, chain) to ask next, lowest rank first
        self._held: set[int] = set()  # chains whose next key waits for their first key's answer
        self._holds = False  # set by `start`
        self._end = [len(chain) for chain in chains]  # a chain ends at its last key or its first miss
        self._good = [[False] * len(chain) for chain in chains]
        self._published = [0] * len(chains)
        self._waves = [max(_MIN_WAVE, len(chain) // 4) for chain in chains]
        self._lock = threading.Lock()
        self._runners = 0
        self.error: StoreError | None = None

    @property
    def keys(self) -> list[str]:
        return [key for chain in self.chains for key in chain]

    def start(self, submit: Callable[[Callable[[], None]], object], workers: int) -> None:
        """Run the GETs on the io pool (``submit``), ``workers`` at once: on one task where the store keeps
        many GETs in flight on one thread, else on ``workers`` tasks with one GET each at a time."""
        store = self._outcomes.store
        assert store is not None
        if store.gets_many_at_once:
            self._holds = True  # (runners of one GET at a time would end, not wait, while a chain is held)
            self._runners = 1
            submit(lambda: self._runner(lambda store: self._get_each(store, workers)))
            return
        self._runners = min(workers, sum(map(len, self.chains)))
        for _ in range(self._runners):
            submit(lambda: self._runner(self._get_one_by_one))

    def _next(self) -> tuple[int, int] | None:
        """The next (chain, rank) to GET; None when there is none now (the rest of a chain may be held), or
        the batch stops."""
        with self._lock:
            while self._ready and not self._stopped():
                rank, c = heapq.heappop(self._ready)
                if rank >= self._end[c]:
                    continue  # past the chain's first miss
                if rank + 1 < self._end[c]:
                    if self._holds and rank == 0:
                        self._held.add(c)
                    else:
                        heapq.heappush(self._ready, (rank + 1, c))
                return c, rank
            return None

    def _stopped(self) -> bool:
        return self.error is not None or self._stopping.is_set() or not self._outcomes.store_available

    def _wanted(self, at: tuple[int, int]) -> bool:
        """Not past its chain's first miss (the request could not use it), and the batch goes on."""
        c, rank = at
        return rank < self._end[c] and not self._stopped()

    def _get_one_by_one(self, store: ObjectStore) -> None:
        while (at := self._next()) is not None:
            c, rank = at
            self._fetched(c, rank, io.fetch(store, self.chains[c][rank]))

    def _get_each(self, store: ObjectStore, at_once: int) -> None:
        handed_out = True

        def next_item() -> tuple[tuple[int, int], str] | None:
            nonlocal handed_out
            at = self._next()
            if at is None:
                return None
            handed_out = True
            return at, self.chains[at[0]][at[1]]

        def on_fetched(at: tuple[int, int], fetched: io.Fetched) -> None:
            self._fetched(*at, fetched)

        def on_found(at: tuple[int, int]) -> None:
            with self._lock:
                self._release(at[0])

        # Another round when the last handed out keys: a first key that only another region had is answered
        # after the local region's GETs have all ended, and its chain's rest is asked then.
        while handed_out:
            handed_out = False
            io.fetch_as_they_come(
                store, next_item, on_fetched, at_once=at_once, wanted=self._wanted, on_found=on_found
            )

    def _runner(self, get: Callable[[ObjectStore], None]) -> None:
        store = self._outcomes.store
        assert store is not None
        try:
            get(store)
        except StoreError as exc:  # the store fails: the rest is asked again later
            self.error = exc
        except Exception:  # a runner must end (its batch waits for it); unanswered keys are asked again
            log.exception("a probe's GETs failed")
        finally:
            with self._lock:
                self._runners -= 1
                last = self._runners == 0
            if last:
                self._publish_rest()
                self._on_done(self)

    def _fetched(self, c: int, rank: int, fetched: io.Fetched) -> None:
        outcomes = self._outcomes
        if self._timeline is not None:
            self._timeline.mark(GET_RETURNED)
        if fetched.good:
            self._prefetched.offer(fetched)  # no room: still a hit, the load GETs it again
        else:
            outcomes.not_usable(fetched, loading=False)  # answers "missing" now
        with self._lock:
            if fetched.good:
                self._good[c][rank] = True
            else:
                self._end[c] = min(self._end[c], rank)
            self._release(c)  # its first key: the rest goes on, or stops at this miss
            wave = self._wave(c)
        if wave:
            outcomes.in_bucket(wave)

    def _release(self, c: int) -> None:
        """Chain ``c``'s keys after its first go on, if they were held for it (under the lock)."""
        if c in self._held:
            self._held.discard(c)
            heapq.heappush(self._ready, (1, c))

    def _wave(self, c: int) -> list[str]:
        """The keys of chain ``c`` to publish now, if its ready prefix has grown enough (under the lock)."""
        start, good, end = self._published[c], self._good[c], self._end[c]
        ready = start
        while ready < end and good[ready]:
            ready += 1
        if ready == start or (ready < end and ready - start < self._waves[c]):
            return []
        self._published[c] = ready
        return self.chains[c][start:ready]

    def _publish_rest(self) -> None:
        """After the last GET: every hit not published yet (a failed batch leaves gaps; hits stand)."""
        rest: list[str] = []
        with self._lock:
            for c, chain in enumerate(self.chains):
                rest += [chain[r] for r in range(self._published[c], len(chain)) if self._good[c][r]]
                self._published[c] = len(chain)
        if rest:
            self._outcomes.in_bucket(rest)
