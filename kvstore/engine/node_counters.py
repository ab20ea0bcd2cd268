"""Node-wide figures: every process adds its counters' growth to the cache index, so `kvstore stats` and the
admin service report what the node did (every engine, the agent), not what their own process did (nothing).

``NodeCounters`` turns one process's cumulative metrics into increments since its last publication and hands
them to a sink, at most every ``every_s`` seconds and once more at the end: an engine sends them to the node
agent (``AgentLink.counters``), which adds them to the index with its own (``NVMeCache.add_counters``). A
crash loses at most the last interval's figures; so does an agent that is down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from kvstore.errors import KVStoreError
from kvstore.metrics import TIERS, EngineMetrics

log = logging.getLogger(__name__)

FIELDS = ("queries", "hits", "read_bytes", "write_bytes", "checksum_failures")


def counter_name(tier: str, field: str) -> str:
    return f"{tier}.{field}"


class NodeCounters:
    def __init__(
        self, metrics: EngineMetrics, sink: Callable[[Mapping[str, int]], None], *, every_s: float = 2.0
    ) -> None:
        self._metrics = metrics
        self._sink = sink
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
            self._sink({name: delta for name, delta in deltas.items() if delta})
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
        # Not uploads_lost: the index counts it itself, in the transaction that settles each lost chunk,
        # so a process that dies before it publishes cannot leave the node's figure short.
        out["nvme_evictions"] = int(snapshot.evictions)
        return out
