"""The tier's job threads: vLLM's load and store jobs run here, each reported exactly once.

Loads and stores have queues and threads of their own (``workers_per_kind`` each), so a request waiting for
a load never queues behind a store. A thread takes every job waiting in its queue, up to ``batch_chunks``
chunks, and runs them as one batch: one engine call, its I/O spread over the engine's disk threads, one index
commit. Jobs arrive one per request per scheduler step; one at a time, each would wait for its own slowest
chunk and commit alone, and the device would idle between them.

Accounting needs no lock on the scheduler thread: it alone counts submissions and reported results; job
threads only append to a deque (atomic) and notify `drain`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence

from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

log = logging.getLogger(__name__)

RunBatch = Callable[[Sequence[TransferJob]], list[JobResult]]


class JobThreads:
    def __init__(
        self,
        run_loads: RunBatch,
        run_stores: RunBatch,
        *,
        workers_per_kind: int,
        batch_chunks: int,
        on_finished: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_finished`` runs on a job thread after each batch's results are ready to take."""
        self._batch_chunks = batch_chunks
        self._on_finished = on_finished
        self._queues: dict[str, queue.SimpleQueue[TransferJob | None]] = {
            "load": queue.SimpleQueue(),
            "store": queue.SimpleQueue(),
        }
        self._workers_per_kind = workers_per_kind
        self._threads = [
            threading.Thread(target=self._loop, args=(kind, run), name=f"kvstore-{kind}-{i}", daemon=True)
            for kind, run in (("load", run_loads), ("store", run_stores))
            for i in range(workers_per_kind)
        ]
        self._finished: deque[JobResult] = deque()
        self._submitted = 0
        self._reported = 0
        self._idle = threading.Condition()
        self._closed = False
        for thread in self._threads:
            thread.start()

    def submit(self, kind: str, job: TransferJob) -> None:
        """Queue a job (scheduler thread; never blocks). After `close`, the job fails, still reported."""
        self._submitted += 1
        if self._closed:
            self._finish([JobResult(job_id=job.job_id, success=False)])
        else:
            self._queues[kind].put(job)

    def take_finished(self) -> list[JobResult]:
        """Results since the last call (scheduler thread)."""
        done: list[JobResult] = []
        while self._finished:
            done.append(self._finished.popleft())
        self._reported += len(done)
        return done

    @property
    def in_flight(self) -> int:
        return self._submitted - self._reported - len(self._finished)

    def drain(self) -> None:
        """Wait until every submitted job has finished (jobs are never cancelled halfway)."""
        with self._idle:
            self._idle.wait_for(lambda: self.in_flight == 0)

    def close(self) -> None:
        self.drain()
        self._closed = True
        for jobs in self._queues.values():
            for _ in range(self._workers_per_kind):
                jobs.put(None)
        for thread in self._threads:
            thread.join()

    def _loop(self, kind: str, run: RunBatch) -> None:
        jobs = self._queues[kind]
        while (job := jobs.get()) is not None:
            batch, stop = self._batch(jobs, job)
            try:
                results = run(batch)
            except Exception:  # never let a job vanish: vLLM would wait for it forever
                log.exception("KVStoreTier %s batch of %d jobs failed", kind, len(batch))
                results = [JobResult(job_id=j.job_id, success=False) for j in batch]
            self._finish(results)
            if stop:
                return

    def _batch(
        self, jobs: queue.SimpleQueue[TransferJob | None], first: TransferJob
    ) -> tuple[list[TransferJob], bool]:
        """`first` and whatever else waits, within the chunk budget; True when the stop sign was met."""
        batch, chunks = [first], len(first.keys)
        while chunks < self._batch_chunks:
            try:
                more = jobs.get_nowait()
            except queue.Empty:
                break
            if more is None:
                return batch, True
            batch.append(more)
            chunks += len(more.keys)
        return batch, False

    def _finish(self, results: list[JobResult]) -> None:
        self._finished.extend(results)
        with self._idle:
            self._idle.notify_all()
        self._on_finished()
