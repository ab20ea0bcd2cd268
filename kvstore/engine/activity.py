"""Foreground I/O (loads and stores of the vLLM tier) and the background work that yields to it.

A request waits on a load; vLLM's primary-tier slots stay busy until a store is on NVMe. Both share the disk,
the CPU and the GIL with the engine's background work: object hits going to NVMe, uploads from the journal.
So background work waits for a quiet moment (no foreground I/O for ``quiet_s``), but never longer than
``max_wait_s``, so it always makes progress under a load that never pauses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Activity:
    def __init__(self, *, also_busy: Callable[[], bool] = lambda: False) -> None:
        self._also_busy = also_busy  # e.g. probes in flight
        self._running = 0
        self._last_end = 0.0
        self._lock = threading.Lock()

    @contextmanager
    def foreground(self) -> Iterator[None]:
        with self._lock:
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                self._last_end = time.monotonic()

    @property
    def running(self) -> int:
        return self._running

    def busy(self, quiet_s: float) -> bool:
        """Foreground work is running, or ended less than `quiet_s` ago."""
        if self._running or self._also_busy():
            return True
        return time.monotonic() - self._last_end < quiet_s

    def wait_quiet(
        self, quiet_s: float, max_wait_s: float, stop: threading.Event, poll_s: float = 0.005
    ) -> bool:
        """Wait until the foreground has been quiet for `quiet_s`, `max_wait_s` passed, or `stop`; whether it
        is quiet (False: the wait ran out, the foreground is still busy)."""
        deadline = time.monotonic() + max_wait_s
        while self.busy(quiet_s):
            if time.monotonic() >= deadline or stop.is_set():
                return False
            time.sleep(poll_s)
        return True
