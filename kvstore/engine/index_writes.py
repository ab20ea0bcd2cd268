"""The engine's writes to the node's index, each waited for at most a deadline: `IndexWrites`.

LMDB lets one process write at a time, through a lock every process on the node shares (a robust mutex in
``lock.mdb``). A process stopped inside a write transaction (a node agent under SIGSTOP, a deadlock) holds it
until it dies, and every other writer waits. The engine must never wait on the agent: its commits, evictions
and removals run on one thread of their own (``kvstore-index``), and the caller waits for each at most
``timeout_s``. Past it the caller reports a failure (a store: not kept, counted ``index_busy``) and goes on;
while a write is that late, new stores fail at once without writing a file (`busy`).

A write the caller gave up on is never served wrong and never leaks: one that had not started when its
caller gave up is not run (``not_started`` removes its files); one that was already waiting for the lock
finishes when the lock is free (the hung process killed: the robust mutex lets the next writer in), and
``late`` hands its result to whoever can still use it (chunks admitted late are announced then; their files
hold exactly the bytes stored, verified on every read).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["LATE", "IndexWrites", "Late"]

log = logging.getLogger(__name__)

_R = TypeVar("_R")


class Late:
    """What `IndexWrites.run` returns for a write that did not finish in time."""

    def __repr__(self) -> str:
        return "LATE"


LATE = Late()


class _Job(Generic[_R]):
    def __init__(
        self,
        write: Callable[[], _R],
        not_started: Callable[[], object] | None,
        late: Callable[[Any], object] | None,
    ) -> None:
        self.write = write
        self.not_started = not_started
        self.late = late
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.running = False
        self.abandoned = False
        self.result: _R | None = None
        self.error: BaseException | None = None


class IndexWrites:
    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._overdue = 0  # writes given up on that have not finished or been dropped yet
        self._closed = False

    @property
    def busy(self) -> bool:
        """A write has outlived its deadline and not finished: the index's write lock is held elsewhere."""
        return self._overdue > 0

    def run(
        self,
        write: Callable[[], _R],
        *,
        not_started: Callable[[], object] | None = None,
        late: Callable[[_R | BaseException], object] | None = None,
    ) -> _R | Late:
        """``write()`` on the index thread; its result (or its exception, raised here), or `LATE` once
        ``timeout_s`` has passed. Then ``not_started()`` runs instead of the write if it had not begun, or
        ``late(result or exception)`` after it if it had (both on the index thread)."""
        job: _Job[_R] = _Job(write, not_started, late)
        self._start()
        self._jobs.put(job)
        if not job.done.wait(self.timeout_s):
            with job.lock:
                if not job.done.is_set():
                    job.abandoned = True
                    with self._lock:
                        self._overdue += 1
                    log.warning(
                        "an NVMe index write has waited %.1f s for the index's write lock (another process "
                        "holds it: a hung node agent?); going on without it",
                        self.timeout_s,
                    )
                    return LATE
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]  # set with done, and no error

    def _start(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._loop, name="kvstore-index", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            with job.lock:
                skip = job.abandoned
                job.running = not skip
            if skip:
                self._settle(job.not_started)
                continue
            try:
                job.result = job.write()
            except BaseException as exc:  # handed to the caller, or to `late`
                job.error = exc
            with job.lock:
                job.done.set()
                abandoned = job.abandoned
            if abandoned:
                outcome = job.error if job.error is not None else job.result
                self._settle(None if job.late is None else functools.partial(job.late, outcome))

    def _settle(self, then: Callable[[], object] | None) -> None:
        try:
            if then is not None:
                then()
        except Exception:
            log.exception("cleaning up after a late NVMe index write failed")
        finally:
            with self._lock:
                self._overdue -= 1

    def close(self, timeout: float = 1.0) -> None:
        """Let the thread end once the writes queued are done (waits up to ``timeout``; a write still stuck
        on the lock ends when the lock is free)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout)
