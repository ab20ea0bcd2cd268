"""The admin HTTP service: a FastAPI app built by `create_app(node)`, so tests build apps with their own node.

Routes here: `/healthz` (store and cache reachability) and `/metrics` (Prometheus). Resource routers (pins,
warming, GC) plug in beside them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstore.errors import KVStoreError
from kvstore.runtime import Node


def create_app(node: Node) -> FastAPI:
    app = FastAPI(title="kvstore admin", version="0.1.0")
    app.state.node = node
    token = node.settings.admin_token
    app.state.admin_token = token.get_secret_value() if token is not None else None

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        checks: dict[str, Any] = {}
        try:
            node.store.check()
            checks["store"] = {"ok": True, "url": node.store.url}
        except KVStoreError as exc:
            checks["store"] = {"ok": False, "url": node.store.url, "error": str(exc)}
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
        healthy = all(c["ok"] for c in checks.values())
        return JSONResponse({"ok": healthy, **checks}, status_code=200 if healthy else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        registry = node.engine.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
