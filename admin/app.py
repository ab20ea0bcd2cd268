"""The admin HTTP service: a FastAPI app built by `create_app(node)`, so tests build apps with their own node.

Routes here: `/healthz` (store and cache reachability, the node agent; the store is checked in the background,
so it answers within two seconds whatever the store does) and `/metrics` (Prometheus), open to all; the `/v1`
resource routers (`routes_gc`, `routes_jobs`, `routes_pins`, `routes_warm`, `routes_stats`) require the admin
bearer token when one is configured. What they share is built here once and stored on `app.state`; routes
receive it through the dependencies of `kvstore.admin.deps`.
With `events_endpoint` configured, GC jobs publish `BlockRemoved` for each deleted batch (`kvstore.events`).
Library errors a route lets through still answer JSON: a `ConfigError` is the caller's input (422), any other
`KVStoreError` a store or cache that cannot be used now (503); never an unexplained 500. Request size limits
and JSON-safe error answers (NaN, infinities, lone surrogates) come from `kvstore.admin.limits`. A path with a
trailing slash is a 404, never a redirect (whose `Location` would follow the caller's `Host` header).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from kvstore.admin import routes_gc, routes_jobs, routes_pins, routes_stats, routes_warm
from kvstore.admin.jobs import JobRegistry
from kvstore.admin.limits import BodyLimit, http_error, safe_text, validation_error
from kvstore.admin.openapi import errors
from kvstore.admin.status import Refreshed, Snapshot
from kvstore.agent.supervisor import agent_status
from kvstore.cache import NVMeCache
from kvstore.errors import ConfigError, KVStoreError
from kvstore.events import open_publisher
from kvstore.pin_sync import PinSyncLoop
from kvstore.runtime import Node
from kvstore.stats import store_stats

HEALTH_WAIT_S = 1.5  # `/healthz` answers within this (plus local work) whatever the store does
STATS_WAIT_S = 1.0
STATS_MAX_AGE_S = 10.0  # `/v1/stats` lists the bucket at most this often, in the background


def store_health(snapshot: Snapshot[None], url: str) -> dict[str, Any]:
    """The store part of `/healthz` from the last background check."""
    out: dict[str, Any] = {"url": url}
    if snapshot.age_s is not None:
        out["checked_s_ago"] = round(snapshot.age_s, 1)
    if snapshot.overdue_s is not None:
        return {
            **out,
            "ok": False,
            "error": f"no answer from the object store for {snapshot.overdue_s:.1f} s",
        }
    if snapshot.error is not None:
        return {**out, "ok": False, "error": str(snapshot.error)}
    return {**out, "ok": True}


def agent_health(cache: NVMeCache) -> dict[str, Any]:
    """The node agent's part of `/healthz`: whether one runs, and what waits for it (the upload journal)."""
    status = agent_status(cache.directory)
    out: dict[str, Any] = {"ok": status.running and not status.hung, "running": status.running}
    if status.running:
        out.update(pid=status.pid, hung=status.hung)
        if status.heartbeat_age_s is not None:
            out["heartbeat_s_ago"] = round(status.heartbeat_age_s, 1)
    else:
        out["error"] = "no node agent runs: uploads wait in the journal (start `kvstore agent`)"
    try:
        backlog = cache.backlog()
        out["upload_backlog_chunks"] = backlog.chunks
        if backlog.oldest_queued_ns:
            out["upload_backlog_oldest_s"] = round(max(0.0, time.time() - backlog.oldest_queued_ns / 1e9), 1)
    except KVStoreError as exc:
        out["upload_backlog_error"] = str(exc)
    return out


def create_app(node: Node) -> FastAPI:
    # With `events_endpoint` set, GC publishes BlockRemoved for what it deletes; a bad endpoint fails here.
    # Its events name the bucket copy as the tiers do (`object_locality`), so routers match them up.
    publisher = open_publisher(node.settings.events_endpoint, locality=node.settings.object_locality)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Pins made elsewhere (another node, the CLI) reach this node's cache within `pin_sync_s`.
        interval = node.settings.pin_sync_s
        pin_sync = PinSyncLoop(node.cache, node.store, interval) if interval else None
        yield
        if pin_sync is not None:
            pin_sync.stop()
        if publisher is not None:
            publisher.close()

    # No redirect from `/v1/pins/` to `/v1/pins`: Starlette builds its `Location` from the caller's `Host`
    # header, which would let anyone make this service point elsewhere. A trailing slash is a 404.
    app = FastAPI(title="kvstore admin", version="0.1.0", lifespan=lifespan, redirect_slashes=False)
    # Read by the routes through `kvstore.admin.deps` (and `auth.require_token`), never directly.
    app.state.node = node
    token = node.settings.admin_token
    app.state.admin_token = token.get_secret_value() if token is not None else None
    app.state.jobs = JobRegistry()
    app.state.events = publisher
    app.state.gc_on_removed = publisher.publish_removed if publisher is not None else None
    for routes in (routes_gc, routes_jobs, routes_pins, routes_warm, routes_stats):
        app.include_router(routes.router)
    app.add_middleware(BodyLimit, max_bytes=node.settings.admin_max_body_bytes)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)

    @app.exception_handler(KVStoreError)
    def library_error(request: Request, exc: KVStoreError) -> JSONResponse:
        detail = safe_text(str(exc))  # a message may quote input
        if isinstance(exc, ConfigError):
            return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)
        return JSONResponse({"detail": detail}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE)

    # The store is asked on a background thread; a request waits for it 1.5 s at most (see `status`).
    health = Refreshed(node.store.check, max_age_s=2.0, wait_s=HEALTH_WAIT_S, name="health")
    app.state.store_stats = {
        scan: Refreshed(
            functools.partial(store_stats, node, scan_bucket=scan),
            max_age_s=STATS_MAX_AGE_S,
            wait_s=STATS_WAIT_S,
            name="stats",
        )
        for scan in (True, False)
    }

    @app.get("/healthz", responses=errors(503))
    def healthz() -> JSONResponse:
        checks: dict[str, Any] = {"store": store_health(health.get(), node.store.url)}
        try:
            usage = node.cache.usage()
            checks["cache"] = {
                "ok": True,
                "used_bytes": usage.used_bytes,
                "budget_bytes": usage.budget_bytes,
                "entries": usage.entries,
            }
        except KVStoreError as exc:
            checks["cache"] = {"ok": False, "error": str(exc)}
        checks["agent"] = agent_health(node.cache)
        healthy = all(c["ok"] for c in checks.values())
        return JSONResponse({"ok": healthy, **checks}, status_code=200 if healthy else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> Response:
        registry = node.engine.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
