"""The GC admin routes against a real node (real S3 server, real NVMe cache)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from kvstore.admin.app import create_app
from kvstore.admin.routes_gc import router
from prometheus_client import CollectorRegistry

from kvstore.config import load_settings
from kvstore.lease import Lease
from kvstore.metrics import EngineMetrics
from kvstore.runtime import Node, open_node

pytestmark = pytest.mark.integration

KEY = "ns_abc_r0/abc/de_g0/abcdef0123.bin"


@pytest.fixture
def node(s3_server: Any, s3_bucket: str, tmp_path: Path) -> Iterator[Node]:
    settings = load_settings(
        store_url=f"s3://{s3_bucket}",
        s3_endpoint=s3_server.endpoint,
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
        cache_dir=tmp_path / "cache",
        cache_bytes=10 << 20,
    )
    opened = open_node(settings, metrics=EngineMetrics(CollectorRegistry()))
    yield opened
    opened.close()


def make_app(node: Node, token: str | None = None) -> FastAPI:
    app: FastAPI = create_app(node)
    app.include_router(router)
    app.state.admin_token = token
    return app


def wait_job(client: TestClient, job_id: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}", headers=headers)
        assert job.status_code == 200
        body: dict[str, Any] = job.json()
        if body["status"] in ("done", "failed"):
            return body
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish")


def test_auth(node: Node) -> None:
    client = TestClient(make_app(node, token="s3cret"))
    body = {"ttl_seconds": 60}
    assert client.post("/v1/gc", json=body).status_code == 401
    assert client.post("/v1/gc", json=body, headers={"Authorization": "Bearer nope"}).status_code == 403
    assert client.get("/v1/gc/reports").status_code == 401
    assert client.get("/v1/jobs/x", headers={"Authorization": "Bearer nope"}).status_code == 403
    ok = client.post("/v1/gc", json={**body, "dry_run": True}, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 202
    done = wait_job(client, ok.json()["id"], {"Authorization": "Bearer s3cret"})
    assert done["status"] == "done"


def test_gc_job_runs_and_reports_are_listed(node: Node) -> None:
    client = TestClient(make_app(node))
    node.store.put(KEY, b"\x00" * 100)
    node.store.put("ns_abc_r0/abc/de_g0/pinned.bin", b"\x00" * 100)
    time.sleep(1.1)  # S3 times have one-second resolution: make both objects idle past the tiny TTL
    node.cache.pinned = lambda key: 1 if key.endswith("pinned.bin") else 0  # type: ignore[method-assign]
    dry = client.post("/v1/gc", json={"ttl_seconds": 1e-3, "grace_seconds": 0, "dry_run": True})
    assert dry.status_code == 202 and dry.json()["status"] == "pending"
    dry_done = wait_job(client, dry.json()["id"])
    assert dry_done["status"] == "done" and dry_done["result"]["deleted"] == 1
    assert node.store.get(KEY) is not None
    time.sleep(0.01)
    real = client.post("/v1/gc", json={"ttl_seconds": 1e-3, "grace_seconds": 0})
    result = wait_job(client, real.json()["id"])["result"]
    assert result["deleted"] == 1 and result["kept_pinned"] == 1 and not result["dry_run"]
    assert node.store.get(KEY) is None and node.store.get("ns_abc_r0/abc/de_g0/pinned.bin") is not None
    reports = client.get("/v1/gc/reports", params={"limit": 5}).json()["reports"]
    assert [r["id"] for r in reports] == [result["id"], dry_done["result"]["id"]]
    assert len(client.get("/v1/gc/reports", params={"limit": 1}).json()["reports"]) == 1


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"ttl_seconds": 0},
        {"ttl_seconds": -5},
        {"ttl_seconds": "soon"},
        {"ttl_seconds": 10, "max_bytes": 0},
        {"ttl_seconds": 10, "max_bytes": 1.5},
        {"ttl_seconds": 10, "grace_seconds": -1},
        {"ttl_seconds": 10, "dry_run": "maybe"},
        {"ttl_seconds": 10, "unknown": 1},
    ],
)
def test_bad_body_is_422(node: Node, body: dict[str, Any]) -> None:
    client = TestClient(make_app(node))
    response = client.post("/v1/gc", json=body)
    assert response.status_code == 422 and "detail" in response.json()


def test_bad_queries(node: Node) -> None:
    client = TestClient(make_app(node))
    assert client.get("/v1/jobs/nope").status_code == 404
    assert client.get("/v1/jobs/nope").json()["detail"]
    assert client.get("/v1/gc/reports", params={"limit": 0}).status_code == 422
    assert client.get("/v1/gc/reports", params={"limit": "x"}).status_code == 422
    assert (
        client.post("/v1/gc", content=b"not json", headers={"content-type": "application/json"}).status_code
        == 422
    )


def test_second_gc_while_one_runs(node: Node) -> None:
    client = TestClient(make_app(node))
    with Lease(node.store, "gc", ttl_s=60, holder="cron-gc"):
        busy = client.post("/v1/gc", json={"ttl_seconds": 10})
        assert busy.status_code == 409 and "cron-gc" in busy.json()["detail"]
    assert client.post("/v1/gc", json={"ttl_seconds": 10}).status_code == 202


def test_job_fails_clearly_when_lease_taken_after_check(node: Node) -> None:
    app = make_app(node)
    client = TestClient(app)
    lease = Lease(node.store, "gc", ttl_s=60, holder="sneaky")

    def provider(_: Node) -> Any:
        lease.acquire()  # taken between the 409 check and the job's own lease
        return frozenset()

    app.state.gc_pinned = provider
    started = client.post("/v1/gc", json={"ttl_seconds": 10})
    assert started.status_code == 202
    job = wait_job(client, started.json()["id"])
    lease.release()
    assert job["status"] == "failed" and "another GC is running" in job["error"] and "sneaky" in job["error"]
