"""Hostile input to the admin API (issue 23), against a real node (real S3 server, real NVMe cache): text that
is not valid Unicode, names too long for the cache's keys, manifests stored with bad content, tokens that are
part of the real one, trailing slashes with a forged `Host`, and racing deletes. Each answer is a 4xx that
says why, never a 500, and nothing is stored from a refused request."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvstore.admin.app import create_app
from kvstore.cache.records import MAX_KEY_BYTES
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.layout import PIN_PREFIX
from kvstore.runtime import Node
from tests.conftest import open_node_on
from tests.helpers import free_port

pytestmark = pytest.mark.integration

TOKEN = "s3cret-Token-42"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)
LONE = "\ud800"  # a lone surrogate: a Python str, but no valid UTF-8 encodes it


def _settings(cache_dir: Path) -> dict[str, Any]:
    # A vLLM endpoint is configured (nothing listens there): a prompt would go there, and must not get so far.
    return {
        "cache_dir": cache_dir,
        "cache_bytes": 4 << 20,
        "admin_token": TOKEN,
        "vllm_urls": [f"http://127.0.0.1:{free_port()}"],
    }


@pytest.fixture
def node(s3_server: Any, s3_store: Any, open_test_node: Callable[..., Node], tmp_path: Path) -> Node:
    """A node of the test's own, for tests that store something."""
    url = f"s3://{s3_store.bucket}/{s3_store.prefix}"
    opened = open_test_node(s3_server, url, **_settings(tmp_path / "cache"))
    opened.store.put(NS.config_key, json.dumps(NS.fields()).encode())
    return opened


@pytest.fixture
def client(node: Node) -> TestClient:
    return TestClient(create_app(node), headers=AUTH)


@pytest.fixture(scope="module")
def shared_node(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One node for the module's tests that only send what it must refuse, or read: nothing they send may be
    stored, so they share it (a node's start and stop cost half a second), and every one of them finds it
    as empty as the first did."""
    with s3_server.bucket() as bucket:
        opened = open_node_on(s3_server, f"s3://{bucket}", **_settings(tmp_path_factory.mktemp("hostile")))
        try:
            opened.store.put(NS.config_key, json.dumps(NS.fields()).encode())
            yield opened
        finally:
            opened.close()


@pytest.fixture
def shared_client(shared_node: Node) -> TestClient:
    return TestClient(create_app(shared_node), headers=AUTH)


def post(client: TestClient, route: str, body: dict[str, Any]) -> Any:
    # `json.dumps` escapes the surrogate as `\ud800`, which JSON parsers turn back into it.
    return client.post(route, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def manifests(node: Node) -> list[str]:
    return [info.key for info in node.store.list(PIN_PREFIX)]


BY_ID: dict[str, Any] = {"name": "p", "namespace": NS.id, "token_ids": list(range(32))}
BY_MODEL: dict[str, Any] = {
    "name": "p",
    "model": "org/tiny",
    "tokens_per_hash": 16,
    "dtype": "bfloat16",
    "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["l0"]}],
    "token_ids": list(range(32)),
}

REFUSED = [  # fields the models refuse: the 422 handler echoes the input back
    ("/v1/pins", {**BY_ID, "rank": LONE}),
    ("/v1/pins", {**BY_ID, LONE: 1}),
    ("/v1/pins", {**BY_ID, "token_ids": [1, LONE]}),
    ("/v1/warm", {**BY_ID, "timeout_s": LONE}),
    ("/v1/gc", {"ttl_seconds": LONE}),
]


@pytest.mark.parametrize(("route", "body"), REFUSED)
def test_a_lone_surrogate_in_a_refused_field_is_422(
    shared_client: TestClient, route: str, body: dict[str, Any]
) -> None:
    answer = post(shared_client, route, body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"]


ACCEPTED = [  # fields the models took as they came, until they were checked as text
    {**BY_MODEL, "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": [LONE]}]},
    {**BY_MODEL, "dtype": LONE},
    {**BY_MODEL, "dtype": "bf16\n"},
    {**BY_MODEL, "model": f"org/{LONE}"},
    {**BY_ID, "served_model": LONE},
    {**BY_ID, "name": LONE},
    {**{k: v for k, v in BY_ID.items() if k != "token_ids"}, "prompt": f"hi {LONE}"},
    {**{k: v for k, v in BY_ID.items() if k != "token_ids"}, "messages": [{"role": "user", "content": LONE}]},
    {**{k: v for k, v in BY_ID.items() if k != "token_ids"}, "messages": [{LONE: "user"}]},
    {**BY_MODEL, "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["x" * 10_000]}]},
]


@pytest.mark.parametrize("route", ["/v1/pins", "/v1/warm"])
@pytest.mark.parametrize("body", ACCEPTED)
def test_bad_text_in_any_string_field_is_422_and_stores_nothing(
    shared_client: TestClient, shared_node: Node, route: str, body: dict[str, Any]
) -> None:
    answer = post(shared_client, route, {**body, "pin": "p"} if route == "/v1/warm" else body)
    assert answer.status_code == 422, answer.text
    assert manifests(shared_node) == []
    listed = shared_client.get("/v1/pins")
    assert listed.status_code == 200 and listed.json() == {"pins": []}


def test_a_warm_pin_name_with_a_lone_surrogate_is_422(shared_client: TestClient) -> None:
    answer = post(shared_client, "/v1/warm", {**BY_ID, "pin": LONE})
    assert answer.status_code == 422, answer.text


def test_a_manifest_stored_with_bad_text_is_skipped_not_a_500_for_everyone(
    client: TestClient, node: Node
) -> None:
    good = post(client, "/v1/pins", {**BY_ID, "name": "good"})
    assert good.status_code == 201, good.text
    # As an older service wrote it: the layer name's surrogate escaped in otherwise valid JSON.
    doc = json.loads(node.store.get(f"{PIN_PREFIX}good.json") or b"")
    doc["name"] = "bad"
    doc["namespace_fields"]["kv_cache_groups"][0]["layer_names"] = [LONE]
    node.store.put(f"{PIN_PREFIX}bad.json", json.dumps(doc).encode())
    listed = client.get("/v1/pins")
    assert listed.status_code == 200, listed.text
    assert [p["name"] for p in listed.json()["pins"]] == ["good"]
    assert client.get("/v1/pins/good").status_code == 200
    one = client.get("/v1/pins/bad")
    assert one.status_code == 422 and "malformed" in one.json()["detail"]
    assert client.delete("/v1/pins/bad").status_code == 204  # the operator can still remove it
    assert manifests(node) == [f"{PIN_PREFIX}good.json"]


@pytest.mark.parametrize("route", ["/v1/pins", "/v1/warm"])
def test_a_model_name_too_long_for_the_cache_keys_is_refused_naming_the_limit(
    client: TestClient, node: Node, route: str
) -> None:
    # 200 characters pass the model name's own bound, but three bytes each make 600-byte keys.
    answer = post(client, route, {**BY_MODEL, "model": "\u20ac" * 200})
    assert answer.status_code == 422, answer.text
    assert f"{MAX_KEY_BYTES}-byte" in answer.json()["detail"]
    assert manifests(node) == []
    # The next pin is not affected: it applies to the node like any other.
    fine = post(client, "/v1/pins", {**BY_ID, "name": "fine"})
    assert fine.status_code == 201, fine.text
    assert "error" not in fine.json()["node_pins"] and fine.json()["node_pins"]["pinned"] == 2


def test_a_stored_manifest_with_a_key_too_long_never_fails_later_pins(client: TestClient, node: Node) -> None:
    made = post(client, "/v1/pins", {**BY_ID, "name": "old"})
    assert made.status_code == 201, made.text
    # As a service without the check wrote it: one key longer than the cache's limit.
    doc = json.loads(node.store.get(f"{PIN_PREFIX}old.json") or b"")
    doc["keys"].append(f"{'x' * MAX_KEY_BYTES}.bin")
    node.store.put(f"{PIN_PREFIX}old.json", json.dumps(doc).encode())
    later = post(client, "/v1/pins", {**BY_ID, "name": "later", "token_ids": list(range(100, 132))})
    assert later.status_code == 201, later.text
    assert later.json()["node_pins"] == {"pinned": 2, "unpinned": 0, "total": 4, "skipped": 1}
    assert all(node.cache.pinned(k) == 1 for k in later.json()["keys"])


WRONG_TOKENS = [
    TOKEN[:-1],  # a prefix
    TOKEN[1:],  # a suffix
    TOKEN[3:9],  # a substring
    TOKEN + "x",  # the token and more
    "x" + TOKEN,
    TOKEN + TOKEN,
    TOKEN.upper(),  # wrong case
    TOKEN.lower(),
    TOKEN.swapcase(),
    TOKEN[0],
    TOKEN[:-1] + "3",  # one character off
]


@pytest.mark.parametrize("wrong", WRONG_TOKENS)
def test_only_the_whole_token_is_accepted(shared_node: Node, wrong: str) -> None:
    anon = TestClient(create_app(shared_node))
    assert anon.get("/v1/pins", headers={"Authorization": f"Bearer {wrong}"}).status_code == 403
    assert anon.get("/v1/pins", headers=AUTH).status_code == 200


def test_a_trailing_slash_never_redirects_to_the_callers_host(shared_client: TestClient) -> None:
    for path in ("/v1/pins/", "/v1/gc/reports/", "/v1/stats/", "/healthz/"):
        answer = shared_client.get(path, headers={"Host": "evil.example"}, follow_redirects=False)
        assert answer.status_code == 404, (path, answer.status_code)
        assert "location" not in answer.headers
        assert "evil.example" not in answer.text


def race(n: int, call: Callable[[], int]) -> list[int]:
    """`call()` from `n` threads released at once; their results."""
    barrier = threading.Barrier(n)
    results: list[int] = []

    def one() -> None:
        barrier.wait()
        results.append(call())

    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.slow
def test_racing_deletes_of_one_pin_answer_exactly_one_204(client: TestClient) -> None:
    for round_ in range(5):
        made = post(client, "/v1/pins", {**BY_ID, "name": f"racy{round_}"})
        assert made.status_code == 201, made.text
        codes = race(4, lambda name=f"racy{round_}": client.delete(f"/v1/pins/{name}").status_code)
        assert sorted(codes) == [204, 404, 404, 404], codes
