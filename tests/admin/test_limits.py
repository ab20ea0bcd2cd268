"""What one admin request may cost, against a real node (real S3 server, real NVMe cache): body size (413),
tokens and chunks per pin or warm request (422), manifests in proportion to their keys, odd numbers (422,
never 500) and warm jobs that can be cancelled."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvstore.admin.app import create_app
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.layout import PIN_PREFIX
from kvstore.runtime import Node
from tests.conftest import open_node_on

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AUTH = {"Authorization": "Bearer s3cret"}
NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)
FINE = Namespace(model_name="org/tiny", tokens_per_hash=1, dtype="bfloat16")


LIMITS: dict[str, Any] = {
    "cache_bytes": 4 << 20,
    "admin_token": "s3cret",
    "admin_max_body_bytes": 256 << 10,
    "admin_max_tokens": 20_000,
    "admin_max_chunks": 2_000,
}


@pytest.fixture
def node(s3_server: Any, s3_store: Any, open_test_node: Callable[..., Node]) -> Node:
    url = f"s3://{s3_store.bucket}/{s3_store.prefix}"
    opened = open_test_node(s3_server, url, **LIMITS)
    for ns in (NS, FINE):
        opened.store.put(ns.config_key, json.dumps(ns.fields()).encode())
    return opened


@pytest.fixture
def client(node: Node) -> TestClient:
    return TestClient(create_app(node), headers=AUTH)


@pytest.fixture(scope="module")
def refusing_client(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """One node for the many requests it must refuse (nothing they send is stored, so they share it: a
    node's start and stop cost half a second)."""
    with s3_server.bucket() as bucket:
        shared = open_node_on(
            s3_server, f"s3://{bucket}", cache_dir=tmp_path_factory.mktemp("limits"), **LIMITS
        )
        try:
            for ns in (NS, FINE):
                shared.store.put(ns.config_key, json.dumps(ns.fields()).encode())
            yield TestClient(create_app(shared), headers=AUTH)
        finally:
            shared.close()


def test_a_body_over_the_limit_is_413_declared_or_streamed(client: TestClient) -> None:
    big = json.dumps({"name": "p", "namespace": NS.id, "token_ids": list(range(60_000))}).encode()
    assert len(big) > 256 << 10
    declared = client.post("/v1/pins", content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and "admin_max_body_bytes" in declared.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies as the body streams in
        for start in range(0, len(big), 16 << 10):
            yield big[start : start + 16 << 10]

    streamed = client.post("/v1/pins", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413 and "admin_max_body_bytes" in streamed.json()["detail"]
    small = client.post("/v1/gc", json={"ttl_seconds": 60, "dry_run": True})
    assert small.status_code == 202


@pytest.mark.parametrize("route", ["/v1/pins", "/v1/warm"])
def test_tokens_and_chunks_per_request_are_limited(client: TestClient, route: str) -> None:
    too_many = client.post(route, json={"name": "p", "namespace": NS.id, "token_ids": [1] * 20_001})
    assert too_many.status_code == 422 and "admin_max_tokens" in too_many.json()["detail"]
    # 10,000 tokens are fine at 16 tokens a block, but make 10,000 blocks to hash at 1 a block.
    began = time.monotonic()
    fine = client.post(route, json={"name": "p", "namespace": FINE.id, "token_ids": list(range(10_000))})
    assert fine.status_code == 422 and "admin_max_chunks" in fine.json()["detail"]
    assert time.monotonic() - began < 5  # refused from the counts, nothing hashed
    ok = client.post(route, json={"name": "p", "namespace": NS.id, "token_ids": list(range(10_000))})
    assert ok.status_code in (201, 202), ok.text


def test_a_manifest_is_in_proportion_to_its_keys(client: TestClient, node: Node) -> None:
    tokens = list(range(16 * 1200))  # 1,200 chunk keys
    body = json.dumps({"name": "big", "namespace": NS.id, "token_ids": tokens}).encode()
    made = client.post("/v1/pins", content=body, headers={"content-type": "application/json"})
    assert made.status_code == 201, made.text
    manifest = node.store.get(f"{PIN_PREFIX}big.json")
    assert manifest is not None
    key_bytes = sum(len(k) + 3 for k in made.json()["keys"])  # each key, quoted, with its comma
    assert len(manifest) < key_bytes + 2048 and len(manifest) < 1.5 * len(body)


# Numbers JSON cannot encode back (NaN, infinities, an overflowing 1e999) in number fields of each route.
ODD = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]
NSID = NS.id
BODIES = [  # "@" stands for the odd number
    ("/v1/gc", '{"ttl_seconds": @}'),
    ("/v1/gc", '{"ttl_seconds": 1, "grace_seconds": @}'),
    ("/v1/gc", '{"ttl_seconds": 1, "max_bytes": @}'),
    ("/v1/pins", '{"name": "p", "namespace": "NSID", "token_ids": [1, @]}'),
    ("/v1/pins", '{"name": "p", "namespace": "NSID", "token_ids": [1], "ttl_seconds": @}'),
    ("/v1/pins", '{"name": "p", "namespace": "NSID", "token_ids": [1], "rank": @}'),
    ("/v1/pins", '{"name": "p", "model": "m", "dtype": "x", "tokens_per_hash": @, "token_ids": [1]}'),
    ("/v1/warm", '{"namespace": "NSID", "token_ids": [1], "timeout_s": @}'),
    ("/v1/warm", '{"namespace": "NSID", "token_ids": [1], "poll_s": @}'),
]


@pytest.mark.parametrize("odd", ODD)
@pytest.mark.parametrize(("route", "template"), BODIES)
def test_non_finite_numbers_are_422_never_500(
    refusing_client: TestClient, route: str, template: str, odd: str
) -> None:
    text = template.replace("NSID", NSID).replace("@", odd)
    answer = refusing_client.post(route, content=text.encode(), headers={"content-type": "application/json"})
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"]


def _silent_server() -> tuple[socket.socket, str]:
    """A TCP server that accepts connections and never answers: a vLLM stuck in a long prefill."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    return server, f"http://127.0.0.1:{server.getsockname()[1]}"


def test_delete_cancels_a_warm_job_stuck_in_its_prefill(
    s3_server: Any, s3_store: Any, open_test_node: Callable[..., Node], tmp_path: Path
) -> None:
    server, url = _silent_server()
    try:
        # The configured endpoint (never one from the request) is the silent one.
        store_url = f"s3://{s3_store.bucket}/{s3_store.prefix}"
        stuck = open_test_node(
            s3_server, store_url, cache_dir=tmp_path / "stuck", admin_token="s3cret", vllm_urls=[url]
        )
        stuck.store.put(NS.config_key, json.dumps(NS.fields()).encode())
        client = TestClient(create_app(stuck), headers=AUTH)
        body: dict[str, Any] = {"namespace": NS.id, "token_ids": list(range(64))}
        body.update(timeout_s=600, poll_s=0)
        started = client.post("/v1/warm", json=body)
        assert started.status_code == 202, started.text
        job_id = started.json()["id"]
        accepted: list[socket.socket] = []
        threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
        deadline = time.monotonic() + 30
        while not accepted:  # the job is now waiting for vLLM's answer
            assert time.monotonic() < deadline, "the warm job never called vLLM"
            time.sleep(0.02)
        began = time.monotonic()
        assert client.delete(f"/v1/jobs/{job_id}").status_code == 202
        while client.get(f"/v1/jobs/{job_id}").json()["status"] != "cancelled":
            assert time.monotonic() - began < 10, "cancelling did not end the request (600 s timeout)"
            time.sleep(0.05)
    finally:
        server.close()
