"""Every thread the engine runs, in one place: the thread model of the data path.

``runtime`` builds one ``EngineThreads`` per process and hands it to the engine; nothing else in the engine
starts a thread. Inside vLLM all of them share the GIL with the scheduler thread, so each does blocking I/O
(which releases the GIL) and as little Python per chunk as it can.

==============  =========================  =====================================================
name            how many                   what it does
==============  =========================  =====================================================
kvstore-io      ``io_workers`` (16)        object-store GETs and HEADs: probes, loads that miss;
                                           on S3 one thread keeps a batch's GETs in flight
                                           together (up to ``io_workers``, one epoll)
kvstore-disk    ``disk_workers`` (8)       NVMe chunk files: O_DIRECT reads into vLLM's buffers,
                                           writes straight from them; the device's queue depth
kvstore-upload  ``upload_workers`` (8)     PUTs of queued chunks, each read from its NVMe file
kvstore-journal 1                          claims batches of the upload journal for the upload
                                           threads and records their outcome (service loop)
kvstore-probe   1                          answers the scheduler's probes (service loop)
kvstore-index   1                          the engine's index writes, each waited for at most a
                                           deadline (``index_writes``: never on a hung agent)
kvstore-admit   1                          writes object hits to NVMe at a quiet moment (service)
kvstore-reserve 1, at start, idle priority maps the memory of a burst of GET bodies ahead of the
                                           first loads (``TieredStore.expect_chunks``), then ends
==============  =========================  =====================================================

The vLLM tier adds its own job threads (one for loads, one for stores) that call the engine; the engine
never blocks the scheduler thread itself. The NVMe cache's index adds one per process,
``kvstore-index-flush``, which makes its commits durable once per ``index_flush_s``
(`kvstore.cache.index_flush`). Pool threads start on first use, so a tool that only reads the
index starts none of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

_T = TypeVar("_T")
_R = TypeVar("_R")


class EngineThreads:
    def __init__(self, *, io_workers: int = 16, disk_workers: int = 8, upload_workers: int = 8) -> None:
        self.io_workers = io_workers
        self.disk_workers = disk_workers
        self.upload_workers = upload_workers
        self.io = ThreadPoolExecutor(io_workers, thread_name_prefix="kvstore-io")
        self.disk = ThreadPoolExecutor(disk_workers, thread_name_prefix="kvstore-disk")
        self.upload = ThreadPoolExecutor(upload_workers, thread_name_prefix="kvstore-upload")
        self._services: list[threading.Thread] = []
        self._lock = threading.Lock()

    def service(self, name: str, loop: Callable[[], None]) -> None:
        """Run ``loop`` on a thread of its own until it returns (its owner tells it to stop)."""
        thread = threading.Thread(target=loop, name=name, daemon=True)
        with self._lock:
            self._services.append(thread)
        thread.start()

    def map(
        self, pool: ThreadPoolExecutor, workers: int, fn: Callable[[_T], _R], args: Sequence[_T]
    ) -> list[_R]:
        """``fn`` over ``args`` on ``workers`` threads of ``pool``, results in order. The threads take the
        items one by one from a shared iterator (no future per item: each future's locks are GIL hand-offs
        for the scheduler thread). A lone item runs on the calling thread, with no hand-off."""
        if len(args) <= 1:
            return [fn(a) for a in args]
        out: list[_R | None] = [None] * len(args)
        todo = iter(range(len(args)))  # a range iterator hands each index to exactly one thread
        errors: list[BaseException] = []

        def run() -> None:
            for i in todo:
                try:
                    out[i] = fn(args[i])
                except BaseException as exc:  # re-raised on the caller's thread
                    errors.append(exc)
                    return

        for future in [pool.submit(run) for _ in range(min(workers, len(args)))]:
            future.result()
        if errors:
            raise errors[0]
        return out  # type: ignore[return-value]  # every slot was filled

    def join(self, timeout: float) -> None:
        """Wait for the service loops to end (their owner has told them to stop), then for the pools."""
        with self._lock:
            services = list(self._services)
        for thread in services:
            thread.join(timeout)
        for pool in (self.io, self.disk, self.upload):
            pool.shutdown(wait=True, cancel_futures=True)
