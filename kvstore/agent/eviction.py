"""Keeping the NVMe cache inside its budget, off the data path.

The agent evicts (least recently used first, never a pinned one) whenever the cache holds more than ``high``
of its effective budget, down to ``low``: the engines' stores then find room without evicting inside their
own commits. Where the agent uploads, that headroom is made of uploaded chunks only: a chunk still waiting
for upload (its only copy, which the agent is about to PUT) goes only where the budget itself is exceeded.
The effective budget follows the disk (``NVMeCache.effective_budget``): a filesystem with less room than
``cache_bytes`` shrinks it. With the agent down, a store that finds the budget exceeded evicts in its own
commit, so the budget always holds.
"""

from __future__ import annotations

import logging

from kvstore.cache import NVMeCache
from kvstore.engine.bad_chunks import count_removals
from kvstore.errors import CacheClosed, KVStoreError
from kvstore.metrics import EngineMetrics

log = logging.getLogger(__name__)


class Evictor:
    def __init__(
        self,
        cache: NVMeCache,
        metrics: EngineMetrics,
        *,
        low: float = 0.90,
        high: float = 0.95,
        uploading: bool = True,
    ) -> None:
        if not 0 < low < high <= 1:
            raise ValueError(f"eviction watermarks must satisfy 0 < low < high <= 1, got {low}, {high}")
        self._cache = cache
        self._metrics = metrics
        self._low = low
        self._high = high
        self._keep_pending = uploading  # an agent without a store uploads nothing: nothing to wait for

    def check(self) -> list[str]:
        """Evict down to the low watermark if usage passed the high one; the keys evicted. An eviction that
        fails (a disk so full that not even the index can commit) is tried again at the next check."""
        try:
            budget = self._cache.effective_budget()
            if self._cache.used_bytes() <= budget * self._high:
                return []
            evicted = self._cache.evict(int(budget * self._low), keep_pending=self._keep_pending)
            if self._cache.used_bytes() > budget:  # uploads lag, or the disk shrank the budget
                evicted += self._cache.evict(budget)
        except CacheClosed:
            raise
        except KVStoreError as exc:
            log.warning("cannot evict from the NVMe cache now: %s", exc)
            return []
        count_removals(self._cache, self._metrics)
        if evicted:
            log.debug("evicted %d chunks to stay within %d bytes", len(evicted), budget)
        return evicted
