"""An expiring, bounded cache of object-store existence answers.

Object stores answer "does this chunk exist?" with a network round trip; the scheduler asks the same
question many times while a request waits. Positive answers live long (content-addressed chunks only
disappear through GC), negative answers briefly (another node may upload the chunk any moment).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable


class ProbeCache:
    def __init__(
        self,
        hit_ttl_s: float,
        miss_ttl_s: float,
        max_entries: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hit_ttl = hit_ttl_s
        self._miss_ttl = miss_ttl_s
        self._max = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[bool, float]] = OrderedDict()

    def get(self, key: str) -> bool | None:
        """True/False while a fresh answer is known, else None."""
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            present, expires = found
            if self._clock() >= expires:
                del self._entries[key]
                return None
            return present

    def set(self, key: str, present: bool) -> None:
        ttl = self._hit_ttl if present else self._miss_ttl
        with self._lock:
            self._entries[key] = (present, self._clock() + ttl)
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)

    def forget(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)
