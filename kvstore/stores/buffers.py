"""Buffers for GET bodies, 4 KiB-aligned, whose memory is used again once nothing refers to them.

A fresh buffer costs a page fault and a zeroed page per 4 KiB on its first write: for a 2 MiB chunk that was
a quarter of the GET's process CPU on this repository's bench machine (loopback SeaweedFS, 16 GETs in
flight: 2.2 ms against 1.6-1.7 ms per GET with memory used again, research run of 2026-12-05). So a buffer's
memory goes back to a free list when the last view of it dies (the chunk was loaded, admitted or dropped),
and the next GET of that size class writes into pages already mapped. The free list is bounded; what does
not fit is unmapped.

The memory is a private anonymous mapping: page-aligned (where O_DIRECT takes it, so admitting a fetched
chunk to NVMe writes it as it came) and not shared with a forked child, which starts with an empty list.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref

import numpy as np

__all__ = ["BufferPool", "aligned_buffer"]

_PAGE = 4096  # O_DIRECT's unit, and mmap's
_SIZE_CLASS = 64 << 10  # compressed chunks vary in length: buffers are kept by 64 KiB size class
_MIN_POOLED = 64 << 10  # below this a page fault or two is all a fresh buffer costs
_MAX_FREE_BYTES = 256 << 20  # free memory kept: what the prefetch buffer holds at most by default


class BufferPool:
    """Aligned buffers whose memory returns to a bounded free list when their last view is gone."""

    def __init__(self, max_free_bytes: int = _MAX_FREE_BYTES) -> None:
        self._max_free = max_free_bytes
        self._free: dict[int, list[mmap.mmap]] = {}  # size class -> mappings, the most recent last
        self._free_bytes = 0
        # Reentrant: a buffer can die, and come back here, in a garbage collection run inside `take`.
        self._lock = threading.RLock()

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def take(self, length: int) -> memoryview:
        """A writable buffer of ``length`` bytes, its first byte on a 4 KiB boundary, contents undefined."""
        if length < _MIN_POOLED:
            return _fresh(length)
        size = -(-length // _SIZE_CLASS) * _SIZE_CLASS
        with self._lock:
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
            # The size in use now wins over others kept from before (another chunk size, a benchmark's
            # previous run): a full list of those would leave every buffer of this size mapped afresh.
            while self._free_bytes + size > self._max_free:
                other = max(self._free, key=lambda s: len(self._free[s]) if s != size else 0)
                if other == size or not self._free[other]:
                    return
                self._free[other].pop(0)  # the oldest goes
                self._free_bytes -= other
            self._free.setdefault(size, []).append(memory)
            self._free_bytes += size

    def clear(self) -> None:
        """Let go of the free memory (a forked child: the parent's lock and lists are not its own)."""
        self._lock = threading.RLock()
        self._free, self._free_bytes = {}, 0


def _fresh(length: int) -> memoryview:
    block = np.empty(length + _PAGE - 1, dtype=np.uint8)  # not zeroed: the reader writes every byte
    skip = -block.ctypes.data % _PAGE
    return block[skip : skip + length].data


_POOL = BufferPool()
os.register_at_fork(after_in_child=_POOL.clear)


def aligned_buffer(length: int) -> memoryview:
    """A GET body's buffer from the process's pool (see the module docstring)."""
    return _POOL.take(length)
