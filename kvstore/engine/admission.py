"""Object hits onto this node's NVMe, from the bytes the load already fetched and verified: one GET per hit.

A load served from the object store admits what it served, so the next hit stays on the node. Fetching the
chunk again (the node agent did, at idle priority) costs a second GET per hit, and the S3 server's CPU and
bandwidth while the request that is waiting still needs them. Writing at once would compete with that
request's own loads, so verified hits wait here until loads and probes have been quiet for ``quiet_s``, or
``max_delay_s`` at the latest, and then go to disk in one batch (the disk threads write the files, one index
commit admits them). Until then a queued hit is served from here (`held`): a repeat load copies the verified
bytes again and asks the bucket nothing. What does not fit ``budget_bytes`` is not queued: the next hit of
that chunk is served from the bucket again. ``close`` writes what is queued.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from kvstore.engine.io import Fetched
from kvstore.engine.timeline import ADMITTED, Timeline

log = logging.getLogger(__name__)


class Admission:
    def __init__(
        self,
        write: Callable[[list[Fetched]], object],
        busy: Callable[[], bool],
        started: Callable[[], int],
        *,
        budget_bytes: int = 256 << 20,
        quiet_s: float = 0.05,
        max_delay_s: float = 10.0,
    ) -> None:
        """``write`` puts a batch on NVMe; ``busy`` says whether foreground work (loads, probes) runs now,
        ``started`` how many pieces of it have begun so far (a count that only grows)."""
        self._write = write
        self._busy = busy
        self._started = started
        self._budget = budget_bytes
        self._quiet = quiet_s
        self._max_delay = max_delay_s
        self._queued: dict[str, Fetched] = {}  # verified, waiting for the write
        self._lock = threading.Lock()
        self._batches: queue.SimpleQueue[list[Fetched] | None] = queue.SimpleQueue()
        self._closing = threading.Event()
        self.timeline: Timeline | None = None  # milestones for benchmarks

    def offer(self, hits: Sequence[Fetched]) -> None:
        """Queue verified hits (never blocks: the load path calls it)."""
        batch: list[Fetched] = []
        with self._lock:
            for hit in hits:
                size = memoryview(hit.blob).nbytes if hit.blob is not None else 0
                if hit.key in self._queued or size > self._budget:
                    continue  # already on its way, or too much queued
                self._queued[hit.key] = hit
                self._budget -= size
                batch.append(hit)
        if batch:
            self._batches.put(batch)

    def held(self, key: str) -> Fetched | None:
        """The verified hit of ``key`` if it waits here for its write (a load may copy it; never blocks)."""
        return self._queued.get(key)

    def run(self) -> None:
        """The admit thread's loop; returns after ``close``."""
        while (batch := self._batches.get()) is not None:
            self._wait_quiet()
            closing = False
            while not closing:
                try:
                    more = self._batches.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    closing = True
                else:
                    batch.extend(more)
            try:
                self._write(batch)
                if self.timeline is not None:
                    self.timeline.mark(ADMITTED, len(batch))
            except Exception:  # the thread must outlive any one batch; these hits are simply not cached
                log.exception("NVMe admission of %d object hits failed", len(batch))
            finally:
                with self._lock:
                    for hit in batch:
                        self._queued.pop(hit.key, None)
                        self._budget += memoryview(hit.blob).nbytes if hit.blob is not None else 0
            if closing:
                return

    def close(self) -> None:
        """Stop after writing what is queued (at once: nothing waits for a quiet moment any more)."""
        self._closing.set()
        self._batches.put(None)

    def _wait_quiet(self) -> None:
        """Until the foreground has been idle for ``quiet_s``, ``max_delay_s`` passed, or closing.

        Looked at once every ``quiet_s``, not polled: idle then, nothing begun since and idle now is idle
        throughout. (Polled every 5 ms, its wake-ups in vLLM's process cost 13-27 µs of CPU per 2 MiB chunk
        loaded, taking the GIL from the loads it waits for.)"""
        deadline = time.monotonic() + self._max_delay
        while not self._closing.is_set():
            started = self._started()
            idle = not self._busy()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._closing.wait(min(self._quiet, left))
            if idle and not self._busy() and self._started() == started:
                return
