"""The `/v1/pins` routes against a real node (real S3 server, real NVMe cache)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from kvstore.admin.app import create_app
from kvstore.admin.routes_pins import router
from prometheus_client import CollectorRegistry

from kvstore.config import load_settings
from kvstore.hashing import chunk_keys
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.metrics import EngineMetrics
from kvstore.runtime import Node, open_node

NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)


@pytest.fixture
def node(s3_server: Any, s3_store: Any, tmp_path: Path) -> Iterator[Node]:
    settings = load_settings(
        store_url=f"s3://{s3_store.bucket}",
        s3_endpoint=s3_server.endpoint,
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
        cache_dir=tmp_path / "cache",
        cache_bytes=10 << 20,
        admin_token="s3cret",
    )
    opened = open_node(settings, metrics=EngineMetrics(CollectorRegistry()))
    yield opened
    opened.close()


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
