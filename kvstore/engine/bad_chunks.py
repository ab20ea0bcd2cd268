"""The one rule for a chunk that turns out bad, whoever meets it (an engine's load or probe, the node
agent's upload or admission, a warm), and the counting of what left the cache.

Only proven corruption of a chunk in a format this reader knows removes it: its NVMe copy, or the shared
object (content-addressed: the next store of that prefix uploads it again). A chunk this reader cannot
interpret (another version, codec or buffer size, not a kvstore chunk at all) is a miss and is left alone
for the readers that can.
"""

from __future__ import annotations

import contextlib
import logging

from kvstore.cache import NVMeCache
from kvstore.engine.io import Fetched
from kvstore.errors import ChunkCorrupt, StoreError
from kvstore.metrics import EngineMetrics
from kvstore.stores import ObjectStore

log = logging.getLogger(__name__)


def object_not_usable(store: ObjectStore, fetched: Fetched, metrics: EngineMetrics) -> bool:
    """A GET that found no usable chunk (``fetched.error`` None: there was no object): count it, and delete
    the object if it is proven corrupt. True when it was deleted."""
    key, error = fetched.key, fetched.error
    if error is None:
        return False
    if isinstance(error, ChunkCorrupt):
        log.warning("deleting corrupt object %s: %s", key, error)
        metrics.checksum_failures.labels("object").inc()
        with contextlib.suppress(StoreError):
            store.delete(key)
        return True
    log.info("object %s is not for this reader, leaving it alone: %s", key, error)
    metrics.unreadable.labels("object").inc()
    return False


def count_removals(cache: NVMeCache, metrics: EngineMetrics) -> None:
    """What this process removed from the cache since it last counted: evictions, and chunks that left
    before their upload (their only copy), by reason."""
    removals = cache.take_removals()
    if removals.evicted:
        metrics.evictions.inc(removals.evicted)
    for reason, n in removals.lost_uploads.items():
        metrics.uploads_lost.labels(reason).inc(n)


def nvme_copy_corrupt(
    cache: NVMeCache, key: str, why: str, metrics: EngineMetrics, *, path: str | None = None
) -> None:
    """A node-local copy proven bad: discard it (the bucket's copy, if any, still serves); with ``path``,
    only while the cache still holds that file for ``key``."""
    log.warning("discarding corrupt NVMe chunk %s: %s", key, why)
    metrics.checksum_failures.labels("nvme").inc()
    cache.discard(key, path=path)
