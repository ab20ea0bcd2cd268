"""Admin route for this node's figures: `GET /v1/stats`, the JSON `kvstore stats` prints.

It answers within a couple of seconds whatever the object store does: what needs the store comes from a
background run (`kvstore.admin.status`), the rest (tiers, NVMe cache) is live. Its shape follows the node's
tiers and sections (`kvstore.stats`), so it is a plain JSON object rather than a response model.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from kvstore.admin.auth import require_token
from kvstore.admin.deps import NodeDep, StoreStatsDep
from kvstore.admin.openapi import AUTH_ERRORS, errors
from kvstore.stats import local_stats

__all__ = ["router"]

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], tags=["stats"], responses=AUTH_ERRORS)


@router.get("/stats", responses=errors(422))
def stats(
    node: NodeDep, store_stats: StoreStatsDep, scan_bucket: Annotated[bool, Query()] = True
) -> dict[str, Any]:
    """This node's figures. What needs the object store comes from a background run at most a few seconds
    old (`store_sections` says how old, and whether a newer run is overdue); the rest is live."""
    out = local_stats(node)
    snapshot = store_stats[scan_bucket].get()
    if snapshot.value is not None:
        out.update(snapshot.value)
    elif snapshot.error is not None or snapshot.overdue_s is not None:
        problem = {"error": f"object store sections unavailable: {snapshot.error or 'no answer yet'}"}
        out.update(bucket={"skipped": not scan_bucket, **problem}, pins=dict(problem), last_gc=None)
    if snapshot.overdue_s is not None:
        out["store"] = {
            "url": node.store.url,
            "reachable": False,
            "error": f"no answer from the object store for {snapshot.overdue_s:.1f} s",
        }
    out["store_sections"] = {
        "age_s": None if snapshot.age_s is None else round(snapshot.age_s, 1),
        "overdue_s": None if snapshot.overdue_s is None else round(snapshot.overdue_s, 1),
    }
    return out
