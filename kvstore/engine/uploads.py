"""The write-behind queue: chunks waiting for upload, bounded by bytes.

A chunk stays readable from here until its upload finishes, so a store followed at once by a load on a node
without NVMe still hits. When the queue is full the newest chunk is refused (the caller counts a drop):
under a slow or absent object store memory stays bounded and the scheduler never waits.
"""

from __future__ import annotations

import threading
from collections import deque


class UploadQueue:
    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._order: deque[str] = deque()
        self._blobs: dict[str, bytes | memoryview] = {}  # queued or being uploaded
        self._in_flight = 0
        self._cond = threading.Condition()
        self._closed = False

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def offer(self, key: str, blob: bytes | memoryview) -> bool:
        """Queue `blob`; False when it does not fit (or the queue is closed). Duplicates are accepted once."""
        with self._cond:
            if self._closed or self._bytes + len(blob) > self._max_bytes:
                return False
            if key not in self._blobs:
                self._blobs[key] = blob
                self._bytes += len(blob)
                self._order.append(key)
                self._cond.notify()
            return True

    def take(self, timeout: float) -> tuple[str, bytes | memoryview] | None:
        """Next chunk to upload, or None after `timeout` seconds / once closed and empty."""
        with self._cond:
            if not self._order and not self._closed:
                self._cond.wait(timeout)
            if not self._order:
                return None
            key = self._order.popleft()
            self._in_flight += 1
            return key, self._blobs[key]

    def done(self, key: str) -> None:
        with self._cond:
            blob = self._blobs.pop(key, None)
            if blob is not None:
                self._bytes -= len(blob)
            self._in_flight -= 1
            self._cond.notify_all()

    def pending(self, key: str) -> bytes | memoryview | None:
        # Lock-free on purpose: called from the scheduler thread; a dict read is atomic.
        return self._blobs.get(key)

    def wait_empty(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._blobs, timeout)

    def close(self) -> list[str]:
        """Refuse new chunks; return the keys never started (they will not be uploaded)."""
        with self._cond:
            self._closed = True
            abandoned = list(self._order)
            self._order.clear()
            for key in abandoned:
                self._bytes -= len(self._blobs.pop(key))
            self._cond.notify_all()
            return abandoned

    def wait_idle(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout)
