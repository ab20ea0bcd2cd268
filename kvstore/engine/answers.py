"""Where chunks are, as far as this process knows: an expiring, bounded answer cache.

The vLLM scheduler asks about the same chunks many times while a request waits, and it must never block.
So its lookups read only this cache (a plain dict read: no lock, no I/O); a background thread fills it from
the LMDB index and batched object-store probes. Answers expire: "in the object store" lives long
(content-addressed chunks only disappear through GC), "missing" briefly (another node may upload it any
moment), "on this node" in between (another process on the node may evict it; a load then falls back to
the object store, so a stale answer costs a little time, never a wrong byte).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum


class Presence(Enum):
    LOCAL = "local"  # on this node (NVMe, or still in the upload queue): loadable without the network
    REMOTE = "remote"  # in the object store
    MISS = "miss"
    PENDING = "pending"  # not known yet: a probe is (or should be) on its way; ask again


class AnswerCache:
    def __init__(
        self,
        *,
        local_ttl_s: float,
        remote_ttl_s: float,
        miss_ttl_s: float,
        max_entries: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl = {Presence.LOCAL: local_ttl_s, Presence.REMOTE: remote_ttl_s, Presence.MISS: miss_ttl_s}
        self._max = max_entries
        self._clock = clock
        self._write_lock = threading.Lock()
        self._entries: dict[str, tuple[Presence, float]] = {}  # insertion order = eviction order

    @property
    def entries(self) -> dict[str, tuple[Presence, float]]:
        """The answers themselves, key -> (answer, expiry on the cache's clock), for the scheduler's lookup,
        which reads them inline (read-only: only this class writes them)."""
        return self._entries

    def get(self, key: str) -> Presence | None:
        """A fresh answer, or None. Lock-free: a dict read is atomic, and writers replace whole tuples."""
        found = self._entries.get(key)
        if found is None or self._clock() >= found[1]:
            return None
        return found[0]

    def set(self, key: str, answer: Presence) -> None:
        expires = self._clock() + self._ttl[answer]
        with self._write_lock:
            self._entries.pop(key, None)
            self._entries[key] = (answer, expires)
            while len(self._entries) > self._max:
                del self._entries[next(iter(self._entries))]

    def forget(self, key: str) -> None:
        with self._write_lock:
            self._entries.pop(key, None)
