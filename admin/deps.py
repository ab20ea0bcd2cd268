"""What admin routes depend on, as `Annotated` aliases: a route names what it needs (`node: NodeDep`) and
FastAPI hands over what `create_app` stored on the app once, so no route reads `request.app.state` itself
and a test can swap any of them (`app.dependency_overrides[get_node] = ...`).

`create_app` stores: `node` (the `Node` this service runs for), `jobs` (its `JobRegistry`), `gc_on_removed`
(what GC calls with each deleted batch: the events publisher, or `None`) and `store_stats` (the background
computation of `/v1/stats`'s store sections, with and without a bucket scan).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeAlias

from fastapi import Depends, Request

from kvstore.admin.jobs import JobRegistry
from kvstore.admin.status import Refreshed
from kvstore.runtime import Node

__all__ = [
    "BlockRemovedDep",
    "JobsDep",
    "NodeDep",
    "OnRemoved",
    "StoreStats",
    "StoreStatsDep",
    "get_jobs",
    "get_node",
    "get_on_removed",
    "get_store_stats",
]

OnRemoved: TypeAlias = Callable[[list[str]], None]
# By `scan_bucket`: the store sections of `/v1/stats`, each computed in the background (`admin.status`).
StoreStats: TypeAlias = Mapping[bool, Refreshed[dict[str, Any]]]


# Plain reads of the app's state: `async`, so they take no thread from the pool the sync routes run on.
async def get_node(request: Request) -> Node:
    node: Node = request.app.state.node
    return node


async def get_jobs(request: Request) -> JobRegistry:
    jobs: JobRegistry = request.app.state.jobs
    return jobs


async def get_on_removed(request: Request) -> OnRemoved | None:
    on_removed: OnRemoved | None = request.app.state.gc_on_removed
    return on_removed


async def get_store_stats(request: Request) -> StoreStats:
    stats: StoreStats = request.app.state.store_stats
    return stats


NodeDep = Annotated[Node, Depends(get_node)]
JobsDep = Annotated[JobRegistry, Depends(get_jobs)]
BlockRemovedDep = Annotated[OnRemoved | None, Depends(get_on_removed)]
StoreStatsDep = Annotated[StoreStats, Depends(get_store_stats)]
