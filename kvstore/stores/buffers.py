"""Buffers for GET bodies, 4 KiB-aligned, whose memory is used again once nothing refers to them.

A fresh buffer costs a page fault and a zeroed page per 4 KiB on its first write: for a 2 MiB chunk that was
a quarter of the GET's process CPU on this repository's bench machine (loopback SeaweedFS, 16 GETs in
flight: 2.2 ms against 1.6-1.7 ms per GET with memory used again, research run of 2026-12-05). So a buffer's
memory goes back to a free list when the last view of it dies (the chunk was loaded, admitted or dropped),
and the next GET of that size class writes into pages already mapped. The free list is bounded; what does
not fit is unmapped.

A new node's first burst would still fault in every body: its GETs hold dozens of chunks at once (prefetched,
then waiting for their NVMe write), so `reserve` maps and populates that much ahead, in the background, at
the tier's start (`bench tiers`' object path, 2 MiB chunks, research run of 2026-12-07: the first burst's io
thread spent 1,540-1,770 µs of CPU per chunk, 502 page faults each, against 700-850 µs and 4 faults in the
bursts after it). Once the pool has gone unused for a while its free memory is lazily freed (MADV_FREE): the
kernel takes the pages when it needs memory, and until then the next burst writes into them without a fault.

The memory is a private anonymous mapping: page-aligned (where O_DIRECT takes it, so admitting a fetched
chunk to NVMe writes it as it came) and not shared with a forked child, which starts with an empty list.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

__all__ = ["BufferPool", "aligned_buffer", "reserve_buffers"]

_PAGE = 4096  # O_DIRECT's unit, and mmap's
_SIZE_CLASS = 64 << 10  # compressed chunks vary in length: buffers are kept by 64 KiB size class
_MIN_POOLED = 64 << 10  # below this a page fault or two is all a fresh buffer costs
_MAX_FREE_BYTES = 256 << 20  # free memory kept: what the prefetch buffer holds at most by default
_IDLE_S = 30.0  # unused this long, the free memory is the kernel's to take (refaulting: ~1 ms of CPU a MiB)


class BufferPool:
    """Aligned buffers whose memory returns to a bounded free list when their last view is gone."""

    def __init__(
        self,
        max_free_bytes: int = _MAX_FREE_BYTES,
        *,
        idle_s: float = _IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_free = max_free_bytes
        self._idle_s = idle_s
        self._clock = clock
        self._free: dict[int, list[mmap.mmap]] = {}  # size class -> mappings, the most recent last
        self._free_bytes = 0
        self._lazily_freed = False  # the free memory was handed to the kernel (MADV_FREE) since its last use
        self._last_used = clock()
        self._trimmer: threading.Thread | None = None  # alive while there is free memory to watch
        # Reentrant: a buffer can die, and come back here, in a garbage collection run inside `take`.
        self._lock = threading.RLock()

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def take(self, length: int) -> memoryview:
        """A writable buffer of ``length`` bytes, its first byte on a 4 KiB boundary, contents undefined."""
        if length < _MIN_POOLED:
            return _fresh(length)
        size = _size_class(length)
        with self._lock:
            self._used()
            free = self._free.get(size)
            memory = free.pop() if free else None
            if memory is not None:
                self._free_bytes -= size
        if memory is None:
            memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = np.frombuffer(memory, dtype=np.uint8, count=length)
        # Runs when the array dies, which is after every memoryview of it (each holds the array).
        weakref.finalize(view, self._give_back, memory, size).atexit = False
        return view.data

    def _give_back(self, memory: mmap.mmap, size: int) -> None:
        if size > self._max_free:
            return
        with self._lock:
            self._keep(memory, size)

    def _keep(self, memory: mmap.mmap, size: int) -> bool:
        """(Under the lock.) Put ``memory`` on the free list if room can be made for it."""
        # The size in use now wins over others kept from before (another chunk size, a benchmark's
        # previous run): a full list of those would leave every buffer of this size mapped afresh.
        if (len(self._free.get(size, ())) + 1) * size > self._max_free:
            return False
        while self._free_bytes + size > self._max_free:
            other = max(self._free, key=lambda s: len(self._free[s]) if s != size else 0)
            if other == size or not self._free[other]:
                return False
            self._free[other].pop(0)  # the oldest goes
            self._free_bytes -= other
        self._free.setdefault(size, []).append(memory)
        self._free_bytes += size
        self._used()
        return True

    def reserve(self, length: int, count: int) -> int:
        """Map and populate buffers for ``length``-byte bodies until ``count`` of them are free (within the
        bound on free memory, which other sizes' free buffers leave to make room), so that a burst of GETs of
        that size writes into pages already there. Slow (the kernel zeroes every page, with the GIL
        released): call it on a thread of its own. Returns the bytes added."""
        if length < _MIN_POOLED:
            return 0
        size = _size_class(length)
        added = 0
        while True:
            with self._lock:
                if len(self._free.get(size, ())) >= count or size > self._max_free:
                    return added
            memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
            with self._lock:
                if not self._keep(memory, size):
                    return added  # the free list is this size's already, and full
            added += size

    def _used(self) -> None:
        """(Under the lock.) The pool is in use now: its free memory is watched again for idleness."""
        self._last_used = self._clock()
        self._lazily_freed = False
        if self._free_bytes and self._trimmer is None:
            self._start_trimmer()

    def trim_if_idle(self) -> float | None:
        """Hand the free memory to the kernel (MADV_FREE: it takes the pages if it needs them, else they
        stay and are written again without a fault) if the pool went unused for ``idle_s``. Returns the
        seconds until it would be idle that long, or None when nothing is left to watch."""
        with self._lock:
            if not self._free_bytes or self._lazily_freed:
                return None
            wait = self._last_used + self._idle_s - self._clock()
            if wait > 0:
                return wait
            for mappings in self._free.values():
                for memory in mappings:
                    memory.madvise(mmap.MADV_FREE)
            self._lazily_freed = True
            return None

    def _start_trimmer(self) -> None:
        trimmer = threading.Thread(target=self._trim_when_idle, name="kvstore-buffers", daemon=True)
        try:
            trimmer.start()
        except RuntimeError:  # the interpreter is shutting down: the memory goes with the process
            return
        self._trimmer = trimmer

    def _trim_when_idle(self) -> None:
        while True:
            with self._lock:
                wait = self.trim_if_idle()
                if wait is None:
                    self._trimmer = None  # the next buffer given back starts another
                    return
            time.sleep(wait)

    def clear(self) -> None:
        """Let go of the free memory (a forked child: the parent's lock, lists and thread are not its own)."""
        self._lock = threading.RLock()
        self._free, self._free_bytes = {}, 0
        self._trimmer = None


def _size_class(length: int) -> int:
    return -(-length // _SIZE_CLASS) * _SIZE_CLASS


def _fresh(length: int) -> memoryview:
    block = np.empty(length + _PAGE - 1, dtype=np.uint8)  # not zeroed: the reader writes every byte
    skip = -block.ctypes.data % _PAGE
    return block[skip : skip + length].data


_POOL = BufferPool()
os.register_at_fork(after_in_child=_POOL.clear)


def aligned_buffer(length: int) -> memoryview:
    """A GET body's buffer from the process's pool (see the module docstring)."""
    return _POOL.take(length)


def reserve_buffers(length: int, count: int) -> int:
    """`BufferPool.reserve` on the process's pool."""
    return _POOL.reserve(length, count)
