"""`POST /v1/warm` and `GET /v1/stats` against a real node (real S3 server, real NVMe cache)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from kvstore.admin.app import create_app

from kvstore.keys import KVCacheGroup, Namespace
from kvstore.pins import get_pin, keys_for_tokens
from kvstore.runtime import Node

pytestmark = pytest.mark.integration

NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)
TOKENS = list(range(64))  # 4 chunks
AUTH = {"Authorization": "Bearer s3cret"}


@pytest.fixture
def nodes(
    s3_server: Any, s3_store: Any, tmp_path: Path, open_test_node: Callable[..., Node]
) -> tuple[Node, Node]:
    """(producer, admin node): the producer stored the chunks; the admin node shares only the bucket."""
    url = f"s3://{s3_store.bucket}/{s3_store.prefix}"
    producer, admin = (
        open_test_node(s3_server, url, cache_dir=tmp_path / name, cache_bytes=16 << 20, admin_token="s3cret")
        for name in ("a", "b")
    )
    producer.store.put(NS.config_key, json.dumps(NS.fields()).encode())
    keys = keys_for_tokens(NS, TOKENS)
    producer.engine.store_many([(k, bytes(2048)) for k in keys])
    assert producer.engine.flush(30)
    return producer, admin


@pytest.fixture
def client(nodes: tuple[Node, Node]) -> TestClient:
    return TestClient(create_app(nodes[1]), headers=AUTH)


def wait_job(client: TestClient, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = client.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        if body["status"] in ("done", "failed", "cancelled"):
            return body
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish")


def test_warm_job_prefetches_and_pins(client: TestClient, nodes: tuple[Node, Node]) -> None:
    _, admin = nodes
    body = {"namespace": NS.id, "token_ids": TOKENS, "pin": "sys", "ttl_seconds": 60}
    r = client.post("/v1/warm", json=body)
    assert r.status_code == 202, r.text
    accepted = r.json()
    assert accepted["namespace"] == NS.id and accepted["num_tokens"] == 64
    job = wait_job(client, accepted["id"])
    assert job["status"] == "done" and job["kind"] == "warm", job
    result = job["result"]
    assert (result["total"], result["remote"], result["prefetched"], result["still_missing"]) == (4, 4, 4, 0)
    assert result["pin"] == "sys" and result["errors"] == []
    keys = keys_for_tokens(NS, TOKENS)
    assert all(admin.cache.contains_many(keys))
    pin = get_pin(admin.store, "sys")
    assert list(pin.keys) == keys and pin.expires_at is not None


def test_warm_by_model_layout_and_failed_job(client: TestClient) -> None:
    body = {
        "model": NS.model_name,
        "tokens_per_hash": 16,
        "dtype": "bfloat16",
        "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["l0"]}],
        "token_ids": TOKENS,
        "prefetch": False,
    }
    done = wait_job(client, client.post("/v1/warm", json=body).json()["id"])
    assert done["result"]["namespace"] == NS.id and done["result"]["remote"] == 4
    assert done["result"]["prefetched"] == 0

    # Missing chunks and a vLLM URL nobody listens on: the job fails and names the URL.
    dead = {**body, "token_ids": list(range(1000, 1064)), "vllm_url": "http://127.0.0.1:9", "timeout_s": 2}
    failed = wait_job(client, client.post("/v1/warm", json=dead).json()["id"])
    assert failed["status"] == "failed" and "http://127.0.0.1:9" in failed["error"], failed


def test_stats(client: TestClient) -> None:
    r = client.get("/v1/stats")
    assert r.status_code == 200, r.text
    stats = r.json()
    assert stats["bucket"]["chunk_objects"] == 4 and stats["store"]["reachable"] is True
    assert stats["nvme"]["entries"] == 0 and "tiers" in stats
    assert client.get("/v1/stats", params={"scan_bucket": "false"}).json()["bucket"] == {"skipped": True}


def test_auth(nodes: tuple[Node, Node]) -> None:
    client = TestClient(create_app(nodes[1]))
    body = {"namespace": NS.id, "token_ids": TOKENS}
    assert client.post("/v1/warm", json=body).status_code == 401
    assert client.get("/v1/stats").status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert client.post("/v1/warm", json=body, headers=wrong).status_code == 403
    assert client.get("/v1/stats", headers=wrong).status_code == 403


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"token_ids": TOKENS},  # no namespace
        {"namespace": NS.id},  # no tokens
        {"namespace": NS.id, "token_ids": TOKENS, "prompt": "x"},  # two token sources
        {"namespace": NS.id, "prompt": "hello"},  # prompt without model_path
        {"namespace": NS.id, "token_ids": "1,2,3"},
        {"namespace": NS.id, "token_ids": TOKENS, "vllm_url": "localhost:8000"},
        {"namespace": NS.id, "token_ids": TOKENS, "pin": "bad/name"},
        {"namespace": NS.id, "token_ids": TOKENS, "timeout_s": 0},
        {"namespace": NS.id, "token_ids": TOKENS[:10]},  # no full chunk
        {"namespace": "../x", "token_ids": TOKENS},  # invalid namespace id
    ],
)
def test_bad_bodies_are_422(client: TestClient, body: dict[str, Any]) -> None:
    r = client.post("/v1/warm", json=body)
    assert r.status_code == 422, r.text
    assert "detail" in r.json()


def test_unknown_namespace_is_404(client: TestClient) -> None:
    r = client.post("/v1/warm", json={"namespace": "org_tiny_000000000000", "token_ids": TOKENS})
    assert r.status_code == 404 and "not found" in r.json()["detail"]
    assert client.get("/v1/jobs/nope").status_code == 404
