"""Admin routes for jobs (GC runs and warms, see `kvstore.admin.jobs`): `GET /v1/jobs/{id}` polls one,
`DELETE /v1/jobs/{id}` asks it to stop (a GC before its next delete batch, a warm at once)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, status

from kvstore.admin.auth import require_token
from kvstore.admin.deps import JobsDep
from kvstore.admin.jobs import JobOut
from kvstore.admin.openapi import AUTH_ERRORS, errors

__all__ = ["router"]

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], tags=["jobs"], responses=AUTH_ERRORS)


# `result` and `error` are left out until the job has them (never sent as null).
@router.get("/jobs/{job_id}", responses=errors(404), response_model_exclude_none=True)
def get_job(job_id: str, jobs: JobsDep) -> JobOut:
    snapshot = jobs.snapshot(job_id)
    if snapshot is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
    return snapshot


@router.delete(
    "/jobs/{job_id}",
    status_code=status.HTTP_202_ACCEPTED,
    responses=errors(404),
    response_model_exclude_none=True,
)
def cancel_job(job_id: str, jobs: JobsDep) -> JobOut:
    """Ask a job to stop (202 with its state); a finished job is left as it was."""
    snapshot = jobs.cancel(job_id)
    if snapshot is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
    return snapshot
