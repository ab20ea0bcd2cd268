import gc
import os
import resource
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.stores.buffers import BufferPool, aligned_buffer


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


@pytest.mark.parametrize("length", [0, 100, 4096, 64 * 1024, 2 * 1024 * 1024 + 4096, 3 * 1024 * 1024 + 7])
def test_a_buffer_is_aligned_writable_and_as_long_as_asked(length: int) -> None:
    body = aligned_buffer(length)
    assert len(body) == length and not body.readonly
    if length:
        assert _address(body) % 4096 == 0
        body[:] = os.urandom(length)
        body[-1] = 7
        assert body[-1] == 7


def test_memory_comes_back_only_when_the_last_view_of_it_is_gone() -> None:
    pool = BufferPool()
    first = pool.take(256 * 1024)
    first[:] = b"\1" * len(first)
    address = _address(first)
    payload = first[4096:]  # what a verified chunk hands on: a view into the body
    del first
    gc.collect()
    second = pool.take(256 * 1024)  # the first one's payload is alive: its memory is not handed out
    assert _address(second) != address and pool.free_bytes == 0
    assert bytes(payload) == b"\1" * (256 * 1024 - 4096)
    del payload
    assert pool.free_bytes == 256 * 1024
    third = pool.take(256 * 1024 - 5)  # the same size class: the memory comes back, nothing is faulted in
    assert _address(third) == address and pool.free_bytes == 0


def test_the_free_memory_is_bounded_and_the_size_in_use_wins() -> None:
    pool = BufferPool(max_free_bytes=1 << 20)
    held = [pool.take(256 * 1024) for _ in range(6)]
    del held
    assert pool.free_bytes == 1 << 20  # four of six kept, two unmapped
    larger = pool.take(512 * 1024)  # another size class is never served a smaller buffer
    address = _address(larger)
    del larger  # ... and when it comes back, two of the older size make room for it
    assert pool.free_bytes == 1 << 20
    again = pool.take(512 * 1024)
    assert _address(again) == address and pool.free_bytes == 512 * 1024


def test_a_forked_child_starts_with_no_free_memory() -> None:
    from kvstore.stores import buffers

    aligned_buffer(128 * 1024)  # dies at once: its memory is on the process's free list
    assert buffers._POOL.free_bytes >= 128 * 1024
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, str(buffers._POOL.free_bytes).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 64) == b"0"
    os.close(read)
    assert buffers._POOL.free_bytes >= 128 * 1024


def _lazily_freed_bytes() -> int:
    """This process's memory handed to the kernel with MADV_FREE and not taken back yet."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("LazyFree:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no LazyFree in smaps_rollup")


def _faults_writing(view: memoryview) -> int:
    """Page faults this thread takes writing every byte of ``view``."""
    array = np.frombuffer(view, dtype=np.uint8)  # written in place: a source of bytes would fault itself
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    array.fill(7)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_the_free_memory_is_the_kernels_to_take_once_the_pool_has_been_idle_a_while() -> None:
    now = [0.0]
    pool = BufferPool(idle_s=30.0, clock=lambda: now[0])
    body = pool.take(256 * 1024)
    body[:] = b"\1" * len(body)
    address = _address(body)
    del body
    lazy = _lazily_freed_bytes()
    now[0] = 29.0
    assert pool.trim_if_idle() == pytest.approx(1.0)
    pool.take(256 * 1024)  # used again at 29 s (dies at once): another 30 s before its memory goes
    now[0] = 58.0
    assert pool.trim_if_idle() == pytest.approx(1.0) and _lazily_freed_bytes() == lazy
    now[0] = 59.0
    assert pool.trim_if_idle() is None and _lazily_freed_bytes() >= lazy + 200 * 1024
    assert pool.trim_if_idle() is None  # handed over once, not again until the pool is used
    again = pool.take(256 * 1024)  # the kernel did not need them: the same pages, (nearly) no fault
    assert _address(again) == address and _faults_writing(again) < 16  # of 64 pages


def test_a_thread_of_its_own_lets_the_idle_memory_go_and_then_ends() -> None:
    pool = BufferPool(idle_s=0.05)
    body = pool.take(256 * 1024)
    body[:] = b"\1" * len(body)
    del body
    lazy = _lazily_freed_bytes()
    deadline = time.monotonic() + 30
    while (
        _lazily_freed_bytes() < lazy + 200 * 1024 or pool._trimmer is not None
    ) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool._trimmer is None and _lazily_freed_bytes() >= lazy + 200 * 1024
    body = pool.take(256 * 1024)  # a buffer given back later starts the watch again
    body[:] = b"\1" * len(body)
    del body
    lazy = _lazily_freed_bytes()
    deadline = time.monotonic() + 30
    while _lazily_freed_bytes() < lazy + 200 * 1024 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _lazily_freed_bytes() >= lazy + 200 * 1024


def test_reserved_buffers_are_written_without_a_page_fault() -> None:
    pool = BufferPool()
    length = 2 * 1024 * 1024 + 4096  # a 2 MiB chunk's object
    assert pool.reserve(length, 3) == 3 * (2 * 1024 * 1024 + 64 * 1024)
    assert pool.reserve(length, 3) == 0  # as many are free already
    held = [pool.take(length) for _ in range(3)]
    assert all(_faults_writing(body) < 8 for body in held)  # not 513 each
    fresh = pool.take(length)  # past the reserve: faulted in page by page
    assert _faults_writing(fresh) > 256


def test_a_reserve_stays_within_the_bound_on_free_memory_and_other_sizes_make_room() -> None:
    pool = BufferPool(max_free_bytes=5 * 1024 * 1024)
    assert pool.reserve(256 * 1024, 100) == 5 * 1024 * 1024  # a previous chunk size filled the free list
    assert pool.reserve(2 * 1024 * 1024, 10) == 4 * 1024 * 1024 and pool.free_bytes == 5 * 1024 * 1024
    held = [pool.take(2 * 1024 * 1024) for _ in range(3)]  # two reserved; the third is new
    assert pool.free_bytes == 1024 * 1024 and len(held) == 3
    assert pool.reserve(1000, 10) == 0  # small bodies are not pooled
