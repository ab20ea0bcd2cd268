"""`POST /v1/warm` and `GET /v1/stats` against a real node (real S3 server, real NVMe cache)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvstore.admin.app import create_app
from kvstore.hashing import chunk_keys
from kvstore.key_scheme import record_scheme, scheme_for
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.pins import get_pin
from kvstore.prompts import tokens_from_prompt
from kvstore.runtime import Node
from tests.admin.vllm_standin import SECRET_ANSWER, VLLMStandIn
from tests.conftest import open_node_on
from tests.helpers import wait_job

pytestmark = [pytest.mark.integration, pytest.mark.slow]

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
    record_scheme(producer.store, NS, scheme_for())  # as the producer's tier does at start-up
    keys = chunk_keys(NS, TOKENS)
    producer.engine.store_many([(k, bytes(2048)) for k in keys])
    assert producer.flush(30)
    return producer, admin


@pytest.fixture
def client(nodes: tuple[Node, Node]) -> TestClient:
    return TestClient(create_app(nodes[1]), headers=AUTH)


@pytest.fixture(scope="module")
def refusing_client(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """One admin node, the namespace in its bucket, for the requests it must refuse (nothing they send
    starts a job or stores anything, so they share it: two nodes' start and stop cost a second)."""
    with s3_server.bucket() as bucket:
        admin = open_node_on(
            s3_server,
            f"s3://{bucket}",
            cache_dir=tmp_path_factory.mktemp("warm-api"),
            cache_bytes=16 << 20,
            admin_token="s3cret",
        )
        try:
            admin.store.put(NS.config_key, json.dumps(NS.fields()).encode())
            record_scheme(admin.store, NS, scheme_for())
            yield TestClient(create_app(admin), headers=AUTH)
        finally:
            admin.close()


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
    keys = chunk_keys(NS, TOKENS)
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
    # No endpoint configured: missing chunks stay missing, and the job says why.
    missing = {**body, "token_ids": list(range(1000, 1064))}
    idle = wait_job(client, client.post("/v1/warm", json=missing).json()["id"])
    assert idle["result"]["still_missing"] == 4 and any("vllm_urls" in e for e in idle["result"]["errors"])


@pytest.fixture
def served_client(
    open_test_node: Callable[..., Node], s3_server: Any, s3_store: Any, tmp_path: Path
) -> Callable[..., TestClient]:
    """A client of an admin node whose operator configured these vLLM endpoints (`vllm_urls`)."""

    def make(*urls: str, name: str = "served") -> TestClient:
        url = f"s3://{s3_store.bucket}/{s3_store.prefix}"
        node = open_test_node(
            s3_server, url, cache_dir=tmp_path / name, admin_token="s3cret", vllm_urls=list(urls)
        )
        return TestClient(create_app(node), headers=AUTH)

    return make


def test_missing_chunks_are_produced_by_the_configured_engine(
    nodes: tuple[Node, Node], vllm: VLLMStandIn, served_client: Callable[..., TestClient]
) -> None:
    producer, _ = nodes
    client = served_client(vllm.url)
    prompt = "a returning user " * 40
    tokens = tokens_from_prompt(vllm.model_dir, prompt)

    def prefill(token_ids: list[int]) -> None:  # what an engine running our tier does with the prompt
        producer.engine.store_many([(k, bytes(2048)) for k in chunk_keys(NS, token_ids)])
        producer.flush(30)

    vllm.on_prefill = prefill
    body = {"namespace": NS.id, "served_model": "tiny", "prompt": prompt, "poll_s": 20}
    accepted = client.post("/v1/warm", json=body)
    assert accepted.status_code == 202, accepted.text
    assert accepted.json()["num_tokens"] == len(tokens) and accepted.json()["warnings"] == []
    job = wait_job(client, accepted.json()["id"])
    assert job["status"] == "done", job
    total = len(chunk_keys(NS, tokens))
    assert (job["result"]["produced"], job["result"]["still_missing"]) == (total, 0)
    assert vllm.calls("POST /v1/completions") == [
        {"model": "tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0}
    ]


def test_a_request_names_no_url_and_gets_no_answer_of_the_server(
    nodes: tuple[Node, Node], vllm: VLLMStandIn, served_client: Callable[..., TestClient]
) -> None:
    client = served_client(vllm.url)
    body = {"namespace": NS.id, "token_ids": list(range(2000, 2064))}
    refused = client.post("/v1/warm", json={**body, "vllm_url": "http://169.254.169.254/latest"})
    assert refused.status_code == 422 and "vllm_url" in refused.text
    assert vllm.requests == []
    vllm.refuse_with = 400
    failed = wait_job(client, client.post("/v1/warm", json=body).json()["id"])
    assert failed["status"] == "failed" and vllm.url in failed["error"], failed
    assert SECRET_ANSWER not in json.dumps(failed)

    # An endpoint nobody listens on: the job fails and names it.
    dead = served_client("http://127.0.0.1:9", name="dead")
    job = wait_job(dead, dead.post("/v1/warm", json={**body, "timeout_s": 2}).json()["id"])
    assert job["status"] == "failed" and "http://127.0.0.1:9" in job["error"], job


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
        {"namespace": NS.id, "prompt": "hello"},  # a prompt, and no vLLM endpoint configured to tokenize it
        {"namespace": NS.id, "token_ids": "1,2,3"},
        {"namespace": NS.id, "token_ids": TOKENS, "vllm_url": "http://localhost:8000"},  # never from a body
        {"namespace": NS.id, "token_ids": TOKENS, "model_path": "/etc"},
        {"namespace": NS.id, "token_ids": TOKENS, "pin": "bad/name"},
        {"namespace": NS.id, "token_ids": TOKENS, "timeout_s": 0},
        {"namespace": NS.id, "token_ids": TOKENS[:10]},  # no full chunk
        {"namespace": "../x", "token_ids": TOKENS},  # invalid namespace id
    ],
)
def test_bad_bodies_are_422(refusing_client: TestClient, body: dict[str, Any]) -> None:
    r = refusing_client.post("/v1/warm", json=body)
    assert r.status_code == 422, r.text
    assert "detail" in r.json()


def test_unknown_namespace_is_404(refusing_client: TestClient) -> None:
    r = refusing_client.post("/v1/warm", json={"namespace": "org_tiny_000000000000", "token_ids": TOKENS})
    assert r.status_code == 404 and "not found" in r.json()["detail"]
    assert refusing_client.get("/v1/jobs/nope").status_code == 404
