"""Admin routes for garbage collection: start a GC job, list past GC reports.

GC can take minutes on a big bucket, so `POST /v1/gc` answers 202 with a job id at once and runs the
collector on a background thread (a job of `kvstore.admin.jobs`, polled and cancelled through
`routes_jobs`; a GC stops before its next delete batch): everything that grows with the bucket (pin manifests
included) is read by the job, never by the request. Which chunks stay pinned is `kvstore.gc`'s decision, the
same as for `kvstore gc`: the job passes this node's cache. The bucket lease (`kvstore.lease`) is what
guarantees a single GC fleet-wide; the 409 check before starting is only a courtesy for the common case.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, status
from pydantic import BaseModel, ConfigDict, Field

from kvstore.admin.auth import require_token
from kvstore.admin.deps import BlockRemovedDep, JobsDep, NodeDep
from kvstore.admin.jobs import JobAccepted
from kvstore.admin.openapi import AUTH_ERRORS, PositiveJsonInt, errors
from kvstore.errors import KVStoreError
from kvstore.gc import list_reports, run_gc
from kvstore.lease import holder_gone, read_lease

__all__ = ["GCReportsOut", "GCRequest", "router"]

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], tags=["gc"], responses=AUTH_ERRORS)


class GCRequest(BaseModel):
    """Body of `POST /v1/gc`."""

    model_config = ConfigDict(extra="forbid", strict=True)  # strict: `false` is not a number of seconds

    ttl_seconds: float = Field(ge=0, allow_inf_nan=False)
    max_bytes: PositiveJsonInt | None = None
    grace_seconds: float = Field(default=600.0, ge=0, allow_inf_nan=False)
    dry_run: bool = False


class GCReportsOut(BaseModel):
    """Past GC runs' reports, newest first, as each run wrote it to the bucket (`kvstore.gc.GCReport`)."""

    reports: list[dict[str, Any]]


@router.post("/gc", status_code=status.HTTP_202_ACCEPTED, responses=errors(400, 409, 413, 422, 503))
def start_gc(body: GCRequest, node: NodeDep, jobs: JobsDep, on_removed: BlockRemovedDep) -> JobAccepted:
    try:
        lease = read_lease(node.store, "gc")  # one small GET, bounded by the store's data-path deadline
    except KVStoreError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"object store unusable: {exc}") from None
    if lease is not None and lease.live(time.time()) and not holder_gone(lease):
        raise HTTPException(status.HTTP_409_CONFLICT, f"a GC is already running (held by {lease.holder!r})")
    job = jobs.create("gc")

    def work() -> dict[str, Any]:
        report = run_gc(
            node.store,
            ttl_seconds=body.ttl_seconds,
            max_bytes=body.max_bytes,
            grace_seconds=body.grace_seconds,
            dry_run=body.dry_run,
            cache=node.cache,
            on_removed=on_removed,
            holder=f"admin-job-{job.id}",
            cancel=job.cancel,
        )
        return report.as_dict()

    accepted = JobAccepted(id=job.id, status=job.status)
    jobs.run(job, work)
    return accepted


@router.get("/gc/reports", responses=errors(422, 503))
def get_reports(node: NodeDep, limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> GCReportsOut:
    try:
        reports = list_reports(node.store, limit)
    except KVStoreError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"cannot read GC reports: {exc}") from None
    return GCReportsOut(reports=reports)
