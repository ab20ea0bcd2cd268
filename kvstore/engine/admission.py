"""When object-store hits reach NVMe: at a quiet moment, within a byte budget.

A load served from the object store admits its chunks to the node's NVMe cache, so the next hit stays on the
node. Writing them at once would compete with the loads of the very request that is waiting (on a node
short of CPU, and on the same disk), so verified hits wait here until loads and probes have been idle for
``quiet_s``, or ``max_delay_s`` at the latest, and then go in one batch (one index commit). What does not fit
the budget is not queued: the next hit of that chunk tries again. ``close`` writes what is queued.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from kvstore.engine.activity import Activity
from kvstore.engine.io import Fetched

log = logging.getLogger(__name__)


class AdmissionQueue:
    def __init__(
        self,
        write: Callable[[list[Fetched]], None],
        activity: Activity,
        *,
        budget_bytes: int = 256 << 20,  # about what `prefetch_bytes` holds: one burst of object hits
        quiet_s: float = 0.05,
        max_delay_s: float = 10.0,
    ) -> None:
        self._write = write
        self._activity = activity
        self._budget = budget_bytes
        self._quiet = quiet_s
        self._max_delay = max_delay_s
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._batches: queue.SimpleQueue[list[Fetched] | None] = queue.SimpleQueue()
        self._closing = threading.Event()

    def offer(self, hits: Sequence[Fetched]) -> None:
        """Queue verified hits (never blocks: the load path calls it)."""
        batch: list[Fetched] = []
        with self._lock:
            for hit in hits:
                size = len(memoryview(hit.blob)) if hit.blob is not None else 0
                if hit.key in self._queued or size > self._budget:
                    continue  # already on its way, or too much queued
                self._queued.add(hit.key)
                self._budget -= size
                batch.append(hit)
        if batch:
            self._batches.put(batch)

    def run(self) -> None:
        """The admit thread's loop; returns after ``close``."""
        while (batch := self._batches.get()) is not None:
            self._activity.wait_quiet(self._quiet, self._max_delay, self._closing)
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
            except Exception:  # the thread must outlive any one batch; these hits are simply not cached
                log.exception("NVMe admission of %d chunks failed", len(batch))
            finally:
                with self._lock:
                    for hit in batch:
                        self._queued.discard(hit.key)
                        self._budget += len(memoryview(hit.blob)) if hit.blob is not None else 0
            if closing:
                return

    def close(self) -> None:
        """Stop after writing what is queued (at once: nothing waits for a quiet moment any more)."""
        self._closing.set()
        self._batches.put(None)
