"""The admin service's jobs: work that outlives its request (a GC run, a warm), run on a daemon thread and
polled by id (`GET /v1/jobs/{id}`), cancelled with `DELETE /v1/jobs/{id}`.

`create_app` builds one `JobRegistry` per app and routes get it through `deps.JobsDep`. The registry lives in
memory: a restart forgets its jobs (GC reports stay in the bucket). Finished jobs are forgotten oldest-first
beyond `MAX_JOBS`, so it stays small. `JobOut` and `JobAccepted` are the jobs' answers on the wire.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from kvstore.errors import KVStoreError
from kvstore.gc import GCCancelled
from kvstore.lease import LeaseHeld

__all__ = ["ACTIVE", "MAX_JOBS", "Job", "JobAccepted", "JobOut", "JobRegistry", "JobStatus"]

log = logging.getLogger(__name__)

JobStatus = Literal["pending", "running", "cancelling", "done", "failed", "cancelled"]
ACTIVE: tuple[JobStatus, ...] = ("pending", "running", "cancelling")
MAX_JOBS = 200  # finished jobs are forgotten oldest-first beyond this


class JobAccepted(BaseModel):
    """The 202 answer of a request that started a job: poll `GET /v1/jobs/{id}`."""

    id: str
    status: JobStatus


class JobOut(BaseModel):
    """A job's state: `result` is the work's report once it returned, `error` why it failed or stopped;
    each is absent until then."""

    id: str
    kind: str
    status: JobStatus
    created_at: float
    result: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class Job:
    id: str
    kind: str
    status: JobStatus = "pending"
    created_at: float = field(default_factory=time.time)
    result: dict[str, Any] | None = None
    error: str | None = None
    # Set by `JobRegistry.cancel`; the work checks it where it can stop cleanly.
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    on_cancel: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def out(self) -> JobOut:
        return JobOut(
            id=self.id,
            kind=self.kind,
            status=self.status,
            created_at=self.created_at,
            result=self.result,
            error=self.error,
        )


class JobRegistry:
    """Jobs of this admin process, by id. Thread-safe: requests and job threads share it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: OrderedDict[str, Job] = OrderedDict()

    def create(self, kind: str) -> Job:
        job = Job(uuid.uuid4().hex[:16], kind)
        with self._lock:
            self._jobs[job.id] = job
            while len(self._jobs) > MAX_JOBS:
                oldest = next(iter(self._jobs))
                if self._jobs[oldest].status in ACTIVE:
                    break
                del self._jobs[oldest]
        return job

    def cancel(self, job_id: str) -> JobOut | None:
        """Ask a job to stop; its state (unchanged if it had already finished), `None` if unknown."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            if job.status not in ACTIVE:
                return job.out()
            job.cancel.set()
            job.status = "cancelling"
            hooks = list(job.on_cancel)
            snapshot = job.out()
        for hook in hooks:  # e.g. closing a warm job's HTTP client, which ends its in-flight request
            try:
                hook()
            except Exception:  # a hook must not turn a cancellation into a 500
                log.exception("cancel hook of job %s failed", job_id)
        return snapshot

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def update(self, job: Job, **changes: Any) -> None:
        with self._lock:
            for name, value in changes.items():
                setattr(job, name, value)

    def snapshot(self, job_id: str) -> JobOut | None:
        with self._lock:
            job = self._jobs.get(job_id)
            return None if job is None else job.out()

    def run(self, job: Job, work: Callable[[], dict[str, Any]]) -> None:
        """Run `work` on a daemon thread, recording its result or its error on `job`."""

        def target() -> None:
            with self._lock:
                if job.status == "pending":
                    job.status = "running"
            try:
                if job.cancel.is_set():
                    raise GCCancelled("cancelled before it started")
                result = work()
            except LeaseHeld as exc:
                self.update(job, status="failed", error=f"another GC is running: {exc}")
            except Exception as exc:
                if job.cancel.is_set():  # whatever the work raised on its way out, it was asked to stop
                    self.update(job, status="cancelled", error=f"cancelled: {exc}")
                elif isinstance(exc, KVStoreError):
                    self.update(job, status="failed", error=str(exc))
                else:  # a job thread must record every failure, never die silently
                    log.exception("job %s failed", job.id)
                    self.update(job, status="failed", error=f"{type(exc).__name__}: {exc}")
            else:
                self.update(job, status="cancelled" if job.cancel.is_set() else "done", result=result)

        threading.Thread(target=target, name=f"kvstore-job-{job.id}", daemon=True).start()
