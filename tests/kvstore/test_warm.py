"""`kvstore.warm` against a real S3 server and real NVMe caches: one node stores, another node warms.

The vLLM request is exercised here through an `httpx.MockTransport` standing in for the server (its handler
uploads the chunks, as the tier would); `tests/connector/test_warm_vllm.py` runs the real thing.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.chunk import encode
from kvstore.errors import ConfigError
from kvstore.hashing import chunk_keys
from kvstore.key_scheme import KeyScheme, SeedMismatch, record_scheme, scheme_for
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.pins import NamespaceNotFound, get_pin
from kvstore.runtime import Node
from kvstore.warm import VLLMError, VLLMUnreachable, prefetch, warm
from tests.cache_helpers import read_chunk

pytestmark = pytest.mark.integration

NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)
TOKENS = list(range(160))  # 10 full chunks


def raw_for(key: str) -> bytes:
    return (key.encode() * 200)[:4096]


@pytest.fixture
def make_node(
    s3_server: Any, s3_store: Any, tmp_path: Path, open_test_node: Callable[..., Node]
) -> Callable[[str], Node]:
    url = f"s3://{s3_store.bucket}/{s3_store.prefix}"
    return lambda name: open_test_node(s3_server, url, cache_dir=tmp_path / name, cache_bytes=16 << 20)


def publish(node: Node, scheme: KeyScheme | None = None) -> None:
    """Describe the namespace as a tier does at start-up: its config and its engine's key scheme."""
    node.store.put(NS.config_key, json.dumps(NS.fields()).encode())
    record_scheme(node.store, NS, scheme or scheme_for())


def seed(node: Node, keys: list[str]) -> None:
    """Publish the namespace and store `keys` through the node's engine (NVMe + write-behind upload)."""
    publish(node)
    node.engine.store_many([(k, raw_for(k)) for k in keys])
    assert node.flush(30)


def test_prefetch_warms_a_second_node(make_node: Callable[[str], Node]) -> None:
    keys = chunk_keys(NS, TOKENS)
    seed(make_node("a"), keys)
    b = make_node("b")
    report = warm(b, NS.id, TOKENS)
    assert (report.total, report.already_local, report.remote, report.prefetched) == (10, 0, 10, 10)
    assert report.produced == 0 and report.still_missing == 0 and report.errors == ()
    assert report.namespace == NS.id and report.num_tokens == 160
    assert all(b.cache.contains_many(keys))
    assert all(read_chunk(b.cache, k) == raw_for(k) for k in keys)

    again = warm(b, NS, TOKENS)
    assert (again.already_local, again.remote, again.prefetched) == (10, 0, 0)
    assert again.as_dict()["errors"] == []


def test_no_prefetch_only_reports(make_node: Callable[[str], Node]) -> None:
    keys = chunk_keys(NS, TOKENS)
    seed(make_node("a"), keys[:4])
    b = make_node("b")
    report = warm(b, NS.id, TOKENS, prefetch=False)
    assert (report.remote, report.prefetched, report.still_missing) == (4, 0, 6)
    assert not any(b.cache.contains_many(keys))


def test_prefetch_function_counts_and_skips_bad_objects(make_node: Callable[[str], Node]) -> None:
    keys = chunk_keys(NS, TOKENS)
    seed(make_node("a"), keys[:3])
    b = make_node("b")
    b.store.put(keys[3], b"not a chunk")
    assert prefetch(b, keys[:5]) == 3  # keys[3] fails verification, keys[4] does not exist
    assert b.cache.contains_many(keys[:5]) == [True, True, True, False, False]
    assert prefetch(b, []) == 0


def test_a_cancelled_warm_stops_before_its_next_batch(make_node: Callable[[str], Node]) -> None:
    keys = chunk_keys(NS, TOKENS)
    seed(make_node("a"), keys)
    b = make_node("b")
    cancel = threading.Event()
    cancel.set()
    report = warm(b, NS.id, TOKENS, cancel=cancel)
    assert (report.remote, report.prefetched) == (10, 0)
    assert not any(b.cache.contains_many(keys))


def test_corrupt_remote_chunk_counts_as_missing(make_node: Callable[[str], Node]) -> None:
    keys = chunk_keys(NS, TOKENS)
    seed(make_node("a"), keys[:9])
    b = make_node("b")
    b.store.put(keys[9], encode(keys[9], b"x" * 64).to_bytes()[:-8])  # truncated: fails its check
    report = warm(b, NS.id, TOKENS)
    assert (report.remote, report.prefetched, report.still_missing) == (9, 9, 1)
    assert any("could not be fetched" in e for e in report.errors)


def test_pin_is_written_once(make_node: Callable[[str], Node]) -> None:
    keys = chunk_keys(NS, TOKENS)
    a = make_node("a")
    seed(a, keys)
    report = warm(a, NS.id, TOKENS, pin="sys", pin_ttl_s=60)
    assert report.pin == "sys" and report.already_local == 10
    assert list(get_pin(a.store, "sys").keys) == keys
    again = warm(a, NS.id, TOKENS, pin="sys")
    assert again.pin is None and any("already exists" in e for e in again.errors)


def test_bad_input(make_node: Callable[[str], Node]) -> None:
    b = make_node("b")
    with pytest.raises(NamespaceNotFound):
        warm(b, NS.id, TOKENS)
    with pytest.raises(ConfigError, match="no full chunk"):
        warm(b, NS, TOKENS[:10])
    with pytest.raises(ConfigError, match="http"):
        warm(b, NS, TOKENS, vllm_url="localhost:8000")


def test_unreachable_vllm_is_a_typed_error_naming_the_url(make_node: Callable[[str], Node]) -> None:
    b = make_node("b")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(VLLMUnreachable, match=url) as info:
        warm(b, NS, TOKENS, vllm_url=url, model="m", timeout_s=2)
    assert info.value.url == url


def test_vllm_request_produces_chunks(make_node: Callable[[str], Node]) -> None:
    keys = chunk_keys(NS, TOKENS)
    a = make_node("a")
    seed(a, keys[:2])
    b = make_node("b")
    seen: list[dict[str, Any]] = []

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served-tiny"}]})
        assert request.url.path == "/v1/completions"
        seen.append(json.loads(request.content))
        # What the tier does after the prefill: write-behind uploads of every full chunk.
        a.engine.store_many([(k, raw_for(k)) for k in keys])
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    with httpx.Client(transport=httpx.MockTransport(server)) as client:
        report = warm(b, NS.id, TOKENS, vllm_url="http://vllm:8000/", poll_s=20, client=client)
    assert seen == [{"model": "served-tiny", "prompt": TOKENS, "max_tokens": 1, "temperature": 0}]
    assert (report.remote, report.prefetched, report.produced, report.still_missing) == (2, 2, 8, 0)
    assert all(a.store.exists_many(keys))


def test_vllm_error_and_chunks_that_never_appear(make_node: Callable[[str], Node]) -> None:
    b = make_node("b")
    publish(b)

    def refuses(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"message": "model 'nope' does not exist"})

    with (
        httpx.Client(transport=httpx.MockTransport(refuses)) as client,
        pytest.raises(VLLMError, match="http://vllm:8000 answered 400") as info,
    ):
        warm(b, NS.id, TOKENS, vllm_url="http://vllm:8000", model="nope", client=client)
    assert info.value.status == 400
    assert "does not exist" not in str(info.value)  # a server's answer is logged here, never passed on

    def ignores(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    with httpx.Client(transport=httpx.MockTransport(ignores)) as client:
        report = warm(b, NS.id, TOKENS, vllm_url="http://vllm:8000", model="m", poll_s=0.3, client=client)
    assert report.produced == 0 and report.still_missing == 10
    assert any("did not appear" in e for e in report.errors)


def test_keeps_kvstore_free_of_vllm_and_torch() -> None:
    import subprocess
    import sys

    code = "import sys, kvstore.warm, kvstore.stats; print(any(m in sys.modules for m in ('vllm', 'torch')))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True
    )
    assert out.stdout.strip() == "False"


def test_a_remembered_miss_does_not_hide_a_new_chunk(make_node: Callable[[str], Node]) -> None:
    keys = chunk_keys(NS, TOKENS)
    a, b = make_node("a"), make_node("b")
    publish(a)
    assert warm(b, NS.id, TOKENS).still_missing == 10  # b's engine now remembers 10 misses
    seed(a, keys)
    report = warm(b, NS.id, TOKENS)
    assert (report.remote, report.prefetched, report.still_missing) == (10, 10, 0)


def test_keys_follow_the_namespace_engines_or_are_refused(
    make_node: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    a, b = make_node("a"), make_node("b")
    cbor = scheme_for("sha256_cbor", "11")
    publish(a, cbor)  # the engines hash with sha256_cbor and PYTHONHASHSEED=11
    with pytest.raises(SeedMismatch, match="set PYTHONHASHSEED as they do"):
        warm(b, NS.id, TOKENS)  # this shell's seed names chunks no engine of the namespace writes
    monkeypatch.setenv("PYTHONHASHSEED", "11")
    keys = chunk_keys(NS, TOKENS, algo="sha256_cbor", seed="11")
    a.engine.store_many([(k, raw_for(k)) for k in keys])
    assert a.flush(30)
    report = warm(b, NS.id, TOKENS, pin="cbor")
    assert (report.hash_algo, report.seed_fingerprint) == ("sha256_cbor", cbor.seed_fingerprint)
    assert (report.remote, report.prefetched, report.errors) == (10, 10, ())
    assert list(get_pin(b.store, "cbor").keys) == keys


def test_a_namespace_without_records_warns(make_node: Callable[[str], Node]) -> None:
    b = make_node("b")
    b.store.put(NS.config_key, json.dumps(NS.fields()).encode())  # written before engines recorded schemes
    report = warm(b, NS.id, TOKENS)
    assert any("records no key scheme" in e for e in report.errors), report.errors
