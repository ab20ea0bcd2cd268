"""The object store's circuit breaker: after a failure, serve from NVMe alone for a cooldown.

A store that times out once will usually time out again; every caller waiting for its own timeout would
stall the node for as long as the outage lasts. So the first failure (a timeout, a refused connection, a
5xx after the client's retries) opens the breaker: for ``cooldown_s`` nobody calls the store, lookups answer
from the index, stores queue their uploads in the NVMe journal. The next call after the cooldown is the
trial: a success closes the breaker (``kvstore:object_store_up`` back to 1), a failure opens it again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvstore.errors import StoreError
from kvstore.metrics import EngineMetrics

log = logging.getLogger(__name__)


class Breaker:
    def __init__(self, cooldown_s: float, metrics: EngineMetrics, clock: Callable[[], float]) -> None:
        self._cooldown = cooldown_s
        self._metrics = metrics
        self._clock = clock
        self._down_until = 0.0
        self._open = False
        self._lock = threading.Lock()

    def available(self) -> bool:
        """Whether the store may be called now (closed, or its cooldown is over: a trial call)."""
        return self._clock() >= self._down_until

    def available_at(self, now: float) -> bool:
        """`available` at a time the caller read from the same clock (the scheduler's hot path)."""
        return now >= self._down_until

    def failed(self, op: str, exc: StoreError) -> None:
        self._metrics.store_errors.labels(op).inc()
        with self._lock:
            if not self._open:
                log.warning(
                    "object store %s failed (%s); serving from NVMe for %.1f s", op, exc, self._cooldown
                )
            self._open = True
            self._down_until = self._clock() + self._cooldown
        self._metrics.object_store_up.set(0)

    def succeeded(self) -> None:
        if not self._open:
            return  # the common case: no lock, no metric write
        with self._lock:
            if self._open and self.available():
                self._open = False
                log.info("object store answers again")
                self._metrics.object_store_up.set(1)
