"""Node-wide figures: every process adds its own counter increments to the cache index, so `kvstore stats`
and the admin service report what the node's tiers did, not what the tool's own process did (nothing).

Each engine publishes the growth of its lookup, hit, byte and failure counters since its last publication,
at most every ``every_s`` seconds, from the probe thread's spare time, and once more when it closes. A crash
loses at most the last interval's figures.
"""

from __future__ import annotations

import logging
import time

from kvstore.cache import NVMeCache
from kvstore.errors import KVStoreError
from kvstore.metrics import TIERS, EngineMetrics

log = logging.getLogger(__name__)

FIELDS = ("queries", "hits", "read_bytes", "write_bytes", "checksum_failures")


def counter_name(tier: str, field: str) -> str:
    return f"{tier}.{field}"


class NodeCounters:
    def __init__(self, metrics: EngineMetrics, cache: NVMeCache, *, every_s: float = 2.0) -> None:
        self._metrics = metrics
        self._cache = cache
        self._every = every_s
        self._published: dict[str, int] = {}
        self._at = time.monotonic()

    def maybe_publish(self) -> None:
        if time.monotonic() - self._at >= self._every:
            self.publish()

    def publish(self) -> None:
        self._at = time.monotonic()
        now = self._current()
        deltas = {name: value - self._published.get(name, 0) for name, value in now.items()}
        try:
            self._cache.add_counters(deltas)
        except KVStoreError as exc:  # figures only: try again next time
            log.debug("could not publish node counters: %s", exc)
            return
        self._published = now

    def _current(self) -> dict[str, int]:
        snapshot = self._metrics.snapshot()
        out: dict[str, int] = {}
        for tier in TIERS:
            figures = snapshot.per_tier[tier]
            for field in FIELDS:
                out[counter_name(tier, field)] = int(getattr(figures, field))
        out["stores_dropped"] = int(snapshot.stores_dropped)
        return out
