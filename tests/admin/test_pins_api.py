"""The `/v1/pins` routes against a real node (real S3 server, real NVMe cache)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from kvstore.admin.app import create_app
from kvstore.admin.routes_pins import router

from kvstore.hashing import chunk_keys
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.runtime import Node

NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)


@pytest.fixture
def node(s3_server: Any, s3_store: Any, open_test_node: Callable[..., Node]) -> Node:
    return open_test_node(s3_server, f"s3://{s3_store.bucket}", cache_bytes=10 << 20, admin_token="s3cret")


@pytest.fixture
def client(node: Node) -> TestClient:
    app = create_app(node)
    app.include_router(router)
    return TestClient(app, headers={"Authorization": "Bearer s3cret"})


def test_pin_lifecycle_by_namespace_id(client: TestClient, node: Node) -> None:
    node.store.put(NS.config_key, json.dumps(NS.fields()).encode())
    tokens = list(range(40))
    r = client.post(
        "/v1/pins", json={"name": "sys", "namespace": NS.id, "token_ids": tokens, "ttl_seconds": 60}
    )
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["keys"] == chunk_keys(NS, tokens) and len(body["keys"]) == 2
    assert body["namespace"] == NS.id and body["expires_at"] > body["created_at"] and body["num_tokens"] == 40
    assert client.get("/v1/pins/sys").json()["keys"] == body["keys"]
    assert [p["name"] for p in client.get("/v1/pins").json()["pins"]] == ["sys"]
    dup = client.post("/v1/pins", json={"name": "sys", "namespace": NS.id, "token_ids": tokens})
    assert dup.status_code == 409 and "already exists" in dup.json()["detail"]
    assert client.delete("/v1/pins/sys").status_code == 204
    assert client.get("/v1/pins/sys").status_code == 404
    assert client.delete("/v1/pins/sys").status_code == 404


def test_pin_by_model_fields_and_prompt(client: TestClient, tmp_path: Path) -> None:
    from kvstore.connector.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    layout = {
        "model": "org/tiny",
        "tokens_per_hash": 16,
        "dtype": "bfloat16",
        "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["l0"]}],
    }
    r = client.post(
        "/v1/pins", json={"name": "p", **layout, "prompt": "the cache " * 30, "model_path": str(model)}
    )
    assert r.status_code == 201, r.text
    assert r.json()["namespace"] == NS.id and r.json()["keys"]
    m = client.post(
        "/v1/pins",
        json={
            "name": "m",
            **layout,
            "model_path": str(model),
            "messages": [{"role": "system", "content": "You are a storage agent. " * 10}],
        },
    )
    assert m.status_code == 201, m.text


def test_errors(client: TestClient, node: Node) -> None:
    missing = client.post(
        "/v1/pins", json={"name": "x", "namespace": "nope_000000000000", "token_ids": list(range(32))}
    )
    assert missing.status_code == 404 and "not found" in missing.json()["detail"]
    both = client.post("/v1/pins", json={"name": "x", "namespace": NS.id, "model": "m", "token_ids": [1]})
    assert both.status_code == 422
    no_path = client.post("/v1/pins", json={"name": "x", "namespace": NS.id, "prompt": "hi"})
    assert no_path.status_code == 422
    node.store.put(NS.config_key, json.dumps(NS.fields()).encode())
    short = client.post("/v1/pins", json={"name": "x", "namespace": NS.id, "token_ids": [1, 2, 3]})
    assert short.status_code == 422 and "no full chunk" in short.json()["detail"]
    bad_name = client.post("/v1/pins", json={"name": "a b", "namespace": NS.id, "token_ids": list(range(32))})
    assert bad_name.status_code == 422 and "pin name" in bad_name.json()["detail"]
    assert client.get("/v1/pins/a%20b").status_code == 422
    anon = TestClient(client.app)
    assert anon.get("/v1/pins").status_code == 401
    assert anon.get("/v1/pins", headers={"Authorization": "Bearer wrong"}).status_code == 403


def test_pinned_chunks_survive_eviction_pressure_and_gc(
    s3_server: Any, s3_store: Any, open_test_node: Callable[..., Node]
) -> None:
    """A pin made through the API holds its chunks in a node cache filled far past its budget, and GC (TTL 0,
    no grace) deletes every other chunk from the bucket but none of the pinned ones."""
    budget = 1 << 20
    chunk = 64 << 10  # a cache of 16 such chunks
    url = f"s3://{s3_store.bucket}/{s3_store.prefix}"
    node = open_test_node(s3_server, url, cache_bytes=budget, admin_token="s3cret")
    client = TestClient(create_app(node), headers={"Authorization": "Bearer s3cret"})
    node.store.put(NS.config_key, json.dumps(NS.fields()).encode())
    r = client.post("/v1/pins", json={"name": "system", "namespace": NS.id, "token_ids": list(range(64))})
    assert r.status_code == 201, r.text
    pinned = r.json()["keys"]
    assert len(pinned) == 4 and r.json()["node_pins"]["pinned"] == 4  # applied to this node at once
    payloads = {key: bytes([i + 1]) * chunk for i, key in enumerate(pinned)}
    node.engine.store_many(list(payloads.items()))
    # Other prompts' chunks: 8x the budget, written through the same engine.
    others = chunk_keys(NS, list(range(1000, 1000 + 16 * 128)))
    assert len(others) == 128
    for start in range(0, len(others), 16):
        node.engine.store_many([(k, bytes([7]) * chunk) for k in others[start : start + 16]])
    assert node.engine.flush(60)

    usage = node.cache.usage()
    assert usage.used_bytes <= usage.budget_bytes == budget
    assert all(node.cache.contains_many(pinned))
    assert sum(node.cache.contains_many(others)) < len(others) - 100  # most of them were evicted
    for key, raw in payloads.items():
        assert node.cache.get(key) == raw  # the NVMe copy itself, verified by its checksum

    time.sleep(1.1)  # S3 times have one-second resolution: every object is older than "now" below
    started = client.post("/v1/gc", json={"ttl_seconds": 0, "grace_seconds": 0})
    assert started.status_code == 202, started.text
    job = wait_job(client, started.json()["id"])
    assert job["status"] == "done", job
    report = job["result"]
    # Chunks evicted before their upload never reached the bucket (and were counted as lost uploads).
    lost = node.engine.metrics.registry.get_sample_value("kvstore:uploads_lost_total", {"reason": "evicted"})
    assert lost is not None
    uploaded = 128 - int(lost)
    assert (report["kept_pinned"], report["deleted"], report["kept_young"]) == (4, uploaded, 0)
    assert all(node.store.exists_many(pinned)) and not any(node.store.exists_many(others))


def wait_job(client: TestClient, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        body: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        if body["status"] in ("done", "failed", "cancelled"):
            return body
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish")
