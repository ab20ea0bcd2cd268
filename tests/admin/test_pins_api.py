"""The `/v1/pins` routes against a real node (real S3 server, real NVMe cache). Prompts are tokenized by the
configured vLLM endpoint: a stand-in server with the tiny model's real tokenizer here (`vllm_standin`), vLLM
itself in `tests/connector/test_warm_vllm.py`."""

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
from kvstore.key_scheme import record_scheme, scheme_for
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.prompts import tokens_from_messages, tokens_from_prompt
from kvstore.runtime import Node
from tests.admin.vllm_standin import SECRET_ANSWER, VLLMStandIn
from tests.cache_helpers import read_chunk
from tests.helpers import wait_job

NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)


pytestmark = pytest.mark.slow


@pytest.fixture
def node(s3_server: Any, s3_bucket: str, open_test_node: Callable[..., Node]) -> Node:
    return open_test_node(s3_server, f"s3://{s3_bucket}", cache_bytes=10 << 20, admin_token="s3cret")


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


@pytest.fixture
def served_client(
    s3_server: Any, s3_store: Any, vllm: VLLMStandIn, open_test_node: Callable[..., Node], tmp_path: Path
) -> TestClient:
    """An admin service whose operator configured one vLLM endpoint (and a namespace its engines wrote)."""
    url = f"s3://{s3_store.bucket}/{s3_store.prefix}"
    node = open_test_node(
        s3_server,
        url,
        cache_dir=tmp_path / "v",
        admin_token="s3cret",
        vllm_urls=[vllm.url, "http://127.0.0.1:9"],
    )
    node.store.put(NS.config_key, json.dumps(NS.fields()).encode())
    record_scheme(node.store, NS, scheme_for())
    return TestClient(create_app(node), headers={"Authorization": "Bearer s3cret"})


LAYOUT = {
    "model": "org/tiny",
    "tokens_per_hash": 16,
    "dtype": "bfloat16",
    "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["l0"]}],
}


def test_prompts_and_messages_are_tokenized_by_the_served_engine(
    served_client: TestClient, vllm: VLLMStandIn, tiny_model: Path
) -> None:
    prompt = "the cache " * 30
    r = served_client.post("/v1/pins", json={"name": "p", **LAYOUT, "prompt": prompt})
    assert r.status_code == 201, r.text
    assert r.json()["namespace"] == NS.id and r.json()["keys"] == chunk_keys(
        NS, tokens_from_prompt(tiny_model, prompt)
    )
    assert vllm.calls("POST /tokenize") == [{"model": "tiny", "prompt": prompt, "add_special_tokens": True}]

    system = [{"role": "system", "content": "You are a storage agent. " * 10}]
    # A namespace id and the served model together (a 422 before), and messages in the served template.
    m = served_client.post(
        "/v1/pins", json={"name": "m", "namespace": NS.id, "served_model": "tiny", "messages": system}
    )
    assert m.status_code == 201, m.text
    assert m.json()["keys"] == chunk_keys(NS, tokens_from_messages(tiny_model, system))
    assert vllm.calls("POST /tokenize")[-1] == {
        "model": "tiny",
        "messages": system,
        "add_generation_prompt": False,
        "add_special_tokens": False,
    }
    unknown = served_client.post(
        "/v1/pins", json={"name": "u", "namespace": NS.id, "served_model": "other", "prompt": prompt}
    )
    assert unknown.status_code == 422 and "serves a model named 'other'" in unknown.json()["detail"]


def test_the_service_takes_no_paths_and_no_urls_from_a_request(
    client: TestClient, served_client: TestClient, node: Node, tiny_model: Path
) -> None:
    node.store.put(NS.config_key, json.dumps(NS.fields()).encode())
    path = served_client.post(
        "/v1/pins",
        json={"name": "x", "namespace": NS.id, "prompt": "hi " * 40, "model_path": str(tiny_model)},
    )
    assert path.status_code == 422 and "model_path" in path.text
    url = served_client.post(
        "/v1/pins", json={"name": "x", "namespace": NS.id, "prompt": "hi", "vllm_url": "http://evil:1"}
    )
    assert url.status_code == 422 and "vllm_url" in url.text
    # No endpoint configured: a prompt cannot be tokenized here at all.
    none = client.post("/v1/pins", json={"name": "x", "namespace": NS.id, "prompt": "hi " * 40})
    assert none.status_code == 422 and "vllm_urls" in none.json()["detail"]


def test_a_served_model_of_another_namespace_or_a_refusing_engine(
    served_client: TestClient, vllm: VLLMStandIn
) -> None:
    other = Namespace(model_name="org/other", tokens_per_hash=16, dtype="bfloat16")
    served_client.app.state.node.store.put(other.config_key, json.dumps(other.fields()).encode())
    r = served_client.post("/v1/pins", json={"name": "o", "namespace": other.id, "prompt": "hi " * 40})
    assert r.status_code == 422 and "runs 'org/tiny'" in r.json()["detail"]
    vllm.refuse_with = 500
    broken = served_client.post("/v1/pins", json={"name": "b", "namespace": NS.id, "prompt": "hi " * 40})
    assert broken.status_code == 503 and vllm.url in broken.json()["detail"]
    assert SECRET_ANSWER not in broken.text  # what the server said stays in the service's log


def test_seeds_and_present_chunks(client: TestClient, node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    node.store.put(NS.config_key, json.dumps(NS.fields()).encode())
    tokens = list(range(64))
    old = client.post("/v1/pins", json={"name": "old", "namespace": NS.id, "token_ids": tokens})
    assert old.status_code == 201 and "records no key scheme" in old.json()["warnings"][0]
    assert old.json()["present_chunks"] == 0  # nothing stored yet: the pin protects nothing so far
    keys = old.json()["keys"]
    node.engine.store_many([(k, bytes(1024)) for k in keys[:3]])
    assert node.flush(30)
    assert client.get("/v1/pins/old").json()["present_chunks"] == 3

    record_scheme(node.store, NS, scheme_for("sha256", "1234"))  # the engines run with PYTHONHASHSEED=1234
    refused = client.post("/v1/pins", json={"name": "new", "namespace": NS.id, "token_ids": tokens})
    assert refused.status_code == 422 and "PYTHONHASHSEED" in refused.json()["detail"]
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    fine = client.post("/v1/pins", json={"name": "new", "namespace": NS.id, "token_ids": tokens})
    assert fine.status_code == 201 and fine.json()["warnings"] == []
    assert fine.json()["keys"] == chunk_keys(NS, tokens, seed="1234") != keys


def test_errors(client: TestClient, node: Node) -> None:
    missing = client.post(
        "/v1/pins", json={"name": "x", "namespace": "nope_000000000000", "token_ids": list(range(32))}
    )
    assert missing.status_code == 404 and "not found" in missing.json()["detail"]
    both = client.post("/v1/pins", json={"name": "x", "namespace": NS.id, "model": "m", "token_ids": [1]})
    assert both.status_code == 422
    no_endpoint = client.post("/v1/pins", json={"name": "x", "namespace": NS.id, "prompt": "hi"})
    assert no_endpoint.status_code in (404, 422)
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
    assert node.flush(60)

    usage = node.cache.usage()
    assert usage.used_bytes <= usage.budget_bytes == budget
    assert all(node.cache.contains_many(pinned))
    assert sum(node.cache.contains_many(others)) < len(others) - 100  # most of them were evicted
    for key, raw in payloads.items():
        assert read_chunk(node.cache, key) == raw  # the NVMe copy itself, verified by its checksum

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
