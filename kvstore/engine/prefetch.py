"""Object-store chunks fetched by the scheduler's probe, held in memory until their load takes them.

The scheduler's probe asks the object store whether chunks exist; a load follows for those that do. On the
vLLM path the probe GETs instead of HEADs (same request count, and a missing key costs the same), so the load
that follows finds the bytes here and the request waits for one network round instead of two. Blobs are
verified as they arrive, on the probe's io thread, so the load only copies them into place. Bounded by bytes;
entries that no load takes within `ttl_s` are dropped (the request went elsewhere, or was cancelled).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvstore.engine.io import Fetched


class PrefetchBuffer:
    def __init__(self, max_bytes: int, *, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self._max_bytes = max_bytes
        self._ttl = ttl_s
        self._clock = clock
        self._bytes = 0
        self._entries: OrderedDict[str, tuple[Fetched, int, float]] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._max_bytes > 0

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def offer(self, fetched: Fetched) -> bool:
        """Hold a verified chunk; False when it does not fit."""
        assert fetched.blob is not None
        size = memoryview(fetched.blob).nbytes
        now = self._clock()
        with self._lock:
            self._expire(now)
            if fetched.key in self._entries:
                return True
            if self._bytes + size > self._max_bytes:
                return False
            self._entries[fetched.key] = (fetched, size, now + self._ttl)
            self._bytes += size
            return True

    def take(self, key: str) -> Fetched | None:
        """The held chunk, removed from the buffer; None if not held (or expired)."""
        if key not in self._entries:  # lock-free fast path: most loads find nothing here
            return None
        now = self._clock()
        with self._lock:
            found = self._entries.pop(key, None)
            self._expire(now)  # loads are what follows probes: a good moment to let go of stale blobs
            if found is None:
                return None
            fetched, size, expires = found
            self._bytes -= size
            return fetched if now < expires else None

    def _expire(self, now: float) -> None:
        while self._entries:
            key, (_, size, expires) = next(iter(self._entries.items()))
            if expires > now:
                return
            del self._entries[key]
            self._bytes -= size
