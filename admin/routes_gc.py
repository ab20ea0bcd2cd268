"""Admin routes for garbage collection: start a GC job, poll and cancel jobs, list past GC reports.

GC can take minutes on a big bucket, so `POST /v1/gc` answers 202 with a job id at once and runs the
collector on a background thread: everything that grows with the bucket (pin manifests included) is read by
the job, never by the request. `GET /v1/jobs/{id}` polls a job, `DELETE /v1/jobs/{id}` cancels it (a GC stops
before its next delete batch). The bucket lease (`kvstore.lease`) is what guarantees a single GC fleet-wide;
the 409 check before starting is only a courtesy for the common case.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request, status
from pydantic import BaseModel, ConfigDict, Field

from kvstore.admin.auth import require_token
from kvstore.admin.openapi import AUTH_ERRORS, PositiveJsonInt, errors
from kvstore.errors import KVStoreError
from kvstore.gc import GCCancelled, list_reports, run_gc
from kvstore.lease import LeaseHeld, read_lease
from kvstore.runtime import Node

__all__ = ["GCRequest", "JobRegistry", "PinnedProvider", "router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], responses=AUTH_ERRORS)

JobStatus = Literal["pending", "running", "cancelling", "done", "failed", "cancelled"]
_ACTIVE = ("pending", "running", "cancelling")
# Given the node, a predicate "is this key pinned" for keys GC keeps beyond the bucket's pin manifests (which
# GC reads itself); `app.state.gc_pinned` replaces the default. Called inside the job.
PinnedProvider = Callable[[Node], Callable[[str], bool]]
_MAX_JOBS = 200  # finished jobs are forgotten oldest-first beyond this, so the registry stays small


class GCRequest(BaseModel):
    """Body of `POST /v1/gc`."""

    model_config = ConfigDict(extra="forbid", strict=True)  # strict: `false` is not a number of seconds

    ttl_seconds: float = Field(ge=0, allow_inf_nan=False)
    max_bytes: PositiveJsonInt | None = None
    grace_seconds: float = Field(default=600.0, ge=0, allow_inf_nan=False)
    dry_run: bool = False


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

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "kind": self.kind, "status": self.status}
        out["created_at"] = self.created_at
        if self.result is not None:
            out["result"] = self.result
        if self.error is not None:
            out["error"] = self.error
        return out


class JobRegistry:
    """Jobs of this admin process, by id (in memory: a restart forgets them; reports stay in the bucket)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: OrderedDict[str, Job] = OrderedDict()

    def create(self, kind: str) -> Job:
        job = Job(uuid.uuid4().hex[:16], kind)
        with self._lock:
            self._jobs[job.id] = job
            while len(self._jobs) > _MAX_JOBS:
                oldest = next(iter(self._jobs))
                if self._jobs[oldest].status in _ACTIVE:
                    break
                del self._jobs[oldest]
        return job

    def cancel(self, job_id: str) -> dict[str, Any] | None:
        """Ask a job to stop; its snapshot (unchanged if it had already finished), `None` if unknown."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            if job.status not in _ACTIVE:
                return job.as_dict()
            job.cancel.set()
            job.status = "cancelling"
            hooks = list(job.on_cancel)
            snapshot = job.as_dict()
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

    def snapshot(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            job = self._jobs.get(job_id)
            return None if job is None else job.as_dict()

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


def node_pins(node: Node) -> Callable[[str], bool]:
    """Default pin source: the node-local NVMe cache's pin counts."""
    return lambda key: node.cache.pinned(key) > 0


def _registry(request: Request) -> JobRegistry:
    state = request.app.state
    registry: JobRegistry | None = getattr(state, "jobs", None)
    if registry is None:
        # Created on first use, under a lock so two first requests cannot each install their own registry.
        with _registry_lock:
            registry = getattr(state, "jobs", None)
            if registry is None:
                registry = JobRegistry()
                state.jobs = registry
    return registry


_registry_lock = threading.Lock()


@router.post("/gc", status_code=status.HTTP_202_ACCEPTED, responses=errors(400, 409, 413, 422, 503))
def start_gc(body: GCRequest, request: Request) -> dict[str, Any]:
    node: Node = request.app.state.node
    try:
        lease = read_lease(node.store, "gc")  # one small GET, bounded by the store's data-path deadline
    except KVStoreError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"object store unusable: {exc}") from None
    if lease is not None and lease.live(time.time()):
        raise HTTPException(status.HTTP_409_CONFLICT, f"a GC is already running (held by {lease.holder!r})")
    provider: PinnedProvider = getattr(request.app.state, "gc_pinned", None) or node_pins
    # Optional hook (e.g. emitting BlockRemoved events) taking each deleted batch.
    on_removed: Callable[[list[str]], None] | None = getattr(request.app.state, "gc_on_removed", None)
    registry = _registry(request)
    job = registry.create("gc")

    def work() -> dict[str, Any]:
        report = run_gc(
            node.store,
            ttl_seconds=body.ttl_seconds,
            max_bytes=body.max_bytes,
            grace_seconds=body.grace_seconds,
            dry_run=body.dry_run,
            pinned=provider(node),
            on_removed=on_removed,
            holder=f"admin-job-{job.id}",
            cancel=job.cancel,
        )
        return report.as_dict()

    accepted = {"id": job.id, "status": job.status}
    registry.run(job, work)
    return accepted


@router.get("/jobs/{job_id}", responses=errors(404))
def get_job(job_id: str, request: Request) -> dict[str, Any]:
    snapshot = _registry(request).snapshot(job_id)
    if snapshot is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
    return snapshot


@router.delete("/jobs/{job_id}", status_code=status.HTTP_202_ACCEPTED, responses=errors(404))
def cancel_job(job_id: str, request: Request) -> dict[str, Any]:
    """Ask a job to stop (202 with its state); a finished job is left as it was."""
    snapshot = _registry(request).cancel(job_id)
    if snapshot is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
    return snapshot


@router.get("/gc/reports", responses=errors(422, 503))
def get_reports(request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> dict[str, Any]:
    node: Node = request.app.state.node
    try:
        reports = list_reports(node.store, limit)
    except KVStoreError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"cannot read GC reports: {exc}") from None
    return {"reports": reports}
