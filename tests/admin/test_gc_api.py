"""The GC admin routes against a real node (real S3 server, real NVMe cache)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from typing_extensions import override

from kvstore import gc as gc_module
from kvstore.admin import routes_gc
from kvstore.admin.app import create_app
from kvstore.events import OWNERSHIP_OBJECT
from kvstore.keys import KVCacheGroup, Namespace, make_offload_key
from kvstore.layout import PIN_PREFIX
from kvstore.lease import Lease, read_lease
from kvstore.pins import create_pin
from kvstore.runtime import Node
from kvstore.stores import ObjectStore
from tests.conftest import open_node_on
from tests.helpers import ForwardingStore, cli_env, listed_older_than, wait_for, wait_job

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KVSTORE = [sys.executable, "-m", "kvstore.admin.cli"]

KEY = "ns_abc_r0/abc/de_g0/abcdef0123.bin"
NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)


@pytest.fixture
def node(s3_server: Any, s3_bucket: str, open_test_node: Callable[..., Node]) -> Node:
    return open_test_node(s3_server, f"s3://{s3_bucket}", cache_bytes=10 << 20)


@pytest.fixture(scope="module")
def refusing_node(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One node for the requests it must refuse (none starts a GC, so they share it: a node's start and stop
    cost half a second)."""
    with s3_server.bucket() as bucket:
        shared = open_node_on(
            s3_server, f"s3://{bucket}", cache_dir=tmp_path_factory.mktemp("gc-api"), cache_bytes=10 << 20
        )
        try:
            yield shared
        finally:
            shared.close()


def make_app(node: Node, token: str | None = None) -> FastAPI:
    app: FastAPI = create_app(node)  # which includes the GC router
    app.state.admin_token = token
    return app


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
    pinned = "ns_abc_r0/abc/de_g0/pinned.bin"
    node.store.put(KEY, b"\x00" * 100)
    node.store.put(pinned, b"\x00" * 100)
    node.cache.pin([pinned])  # a pin in the node's own cache: GC keeps it like a bucket pin
    # GC stretches the grace period by the listings' one-second resolution: past it, both are idle.
    listed_older_than(node.store, [KEY, pinned], 1.0)
    dry = client.post("/v1/gc", json={"ttl_seconds": 1e-3, "grace_seconds": 0, "dry_run": True})
    assert dry.status_code == 202 and dry.json()["status"] == "pending"
    dry_done = wait_job(client, dry.json()["id"])
    assert dry_done["status"] == "done" and dry_done["result"]["deleted"] == 1
    assert node.store.get(KEY) is not None
    real = client.post("/v1/gc", json={"ttl_seconds": 1e-3, "grace_seconds": 0})
    result = wait_job(client, real.json()["id"])["result"]
    assert result["deleted"] == 1 and result["kept_pinned"] == 1 and not result["dry_run"]
    assert node.store.get(KEY) is None and node.store.get(pinned) is not None
    reports = client.get("/v1/gc/reports", params={"limit": 5}).json()["reports"]
    assert [r["id"] for r in reports] == [result["id"], dry_done["result"]["id"]]
    assert len(client.get("/v1/gc/reports", params={"limit": 1}).json()["reports"]) == 1


def test_the_cli_and_the_service_keep_the_same_chunks(
    node: Node, s3_server: Any, s3_bucket: str, tmp_path: Path
) -> None:
    """`kvstore gc` and `POST /v1/gc` share one pin policy (kvstore.gc's): on the same node, both keep the
    bucket's pins and the node's cache pins."""
    bucket_pinned, cache_pinned, idle = (
        NS.chunk_key(make_offload_key(hashlib.sha256(name.encode()).digest(), 0))
        for name in ("bucket", "cache", "idle")
    )
    for key in (bucket_pinned, cache_pinned, idle):
        node.store.put(key, b"\x00" * 100)
    create_pin(node.store, "sys", NS, [bucket_pinned])
    node.cache.pin([cache_pinned])
    listed_older_than(node.store, [bucket_pinned, cache_pinned, idle], 1.0)  # past grace 0
    client = TestClient(make_app(node))
    body = {"ttl_seconds": 0, "grace_seconds": 0, "dry_run": True}
    service = wait_job(client, client.post("/v1/gc", json=body).json()["id"])["result"]
    env = cli_env(
        tmp_path,
        KVSTORE_STORE_URL=f"s3://{s3_bucket}",  # the node's store
        KVSTORE_S3_ENDPOINT=s3_server.endpoint,
        AWS_ACCESS_KEY_ID=s3_server.access_key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
        KVSTORE_CACHE_DIR=str(node.settings.cache_dir),
        KVSTORE_CACHE_BYTES=str(node.settings.cache_bytes),
    )
    args = ["gc", "--dry-run", "--ttl-seconds", "0", "--grace-seconds", "0"]
    done = subprocess.run([*KVSTORE, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    cli = json.loads(done.stdout)
    for report in (service, cli):
        assert (report["objects"], report["deleted"], report["kept_pinned"]) == (3, 1, 2), report


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"ttl_seconds": -5},
        {"ttl_seconds": "soon"},
        {"ttl_seconds": 10, "max_bytes": 0},
        {"ttl_seconds": 10, "max_bytes": 1.5},
        {"ttl_seconds": 10, "grace_seconds": -1},
        {"ttl_seconds": 10, "dry_run": "maybe"},
        {"ttl_seconds": 10, "unknown": 1},
    ],
)
def test_bad_body_is_422(refusing_node: Node, body: dict[str, Any]) -> None:
    client = TestClient(make_app(refusing_node))
    response = client.post("/v1/gc", json=body)
    assert response.status_code == 422 and "detail" in response.json()


def test_bad_queries(refusing_node: Node) -> None:
    client = TestClient(make_app(refusing_node))
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


def test_job_fails_clearly_when_lease_taken_after_check(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(node)
    client = TestClient(app)
    lease = Lease(node.store, "gc", ttl_s=60, holder="sneaky")

    def check_then_taken(store: ObjectStore, name: str) -> Any:
        seen = read_lease(store, name)
        lease.acquire()  # taken between the 409 check and the job's own lease
        return seen

    monkeypatch.setattr(routes_gc, "read_lease", check_then_taken)
    started = client.post("/v1/gc", json={"ttl_seconds": 10})
    assert started.status_code == 202
    job = wait_job(client, started.json()["id"])
    lease.release()
    assert job["status"] == "failed" and "another GC is running" in job["error"] and "sneaky" in job["error"]


def test_gc_publishes_block_removed_for_deleted_chunks_only(
    s3_server: Any, s3_bucket: str, kv_subscriber: Any, open_test_node: Callable[..., Node]
) -> None:
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    url, events = f"s3://{s3_bucket}", kv_subscriber.endpoint
    node = open_test_node(s3_server, url, cache_bytes=10 << 20, events_endpoint=events)
    app = create_app(node)
    client = TestClient(app)
    hashes = {name: hashlib.sha256(name.encode()).digest() for name in ("old", "old1", "pinned", "young")}
    keys = {name: NS.chunk_key(make_offload_key(h, 1 if name == "old1" else 0)) for name, h in hashes.items()}
    for name in ("old", "old1", "pinned"):
        node.store.put(keys[name], b"\x00" * 100)
    create_pin(node.store, "sys", NS, [keys["pinned"]])
    # Past the grace period below (stretched by a second for the listings' resolution), then "young" is
    # written: it stays inside it for two seconds more than the runs need.
    listed_older_than(node.store, [keys[n] for n in ("old", "old1", "pinned")], 3.0)
    node.store.put(keys["young"], b"\x00" * 100)
    body = {"ttl_seconds": 0, "grace_seconds": 2}

    dry = wait_job(client, client.post("/v1/gc", json={**body, "dry_run": True}).json()["id"])
    assert dry["status"] == "done" and dry["result"]["deleted"] == 2
    real = wait_job(client, client.post("/v1/gc", json=body).json()["id"])
    result = real["result"]
    assert (result["deleted"], result["kept_pinned"], result["kept_young"]) == (2, 1, 1)

    # The first batch on the wire is the real run's: the dry run published nothing.
    _, seq, batch = kv_subscriber.next()
    assert seq == 0
    removed = {event.group_idx: event.block_hashes for event in batch.events}
    as_vllm = {name: maybe_convert_block_hash(BlockHash(h)) for name, h in hashes.items()}
    assert removed == {0: [as_vllm["old"]], 1: [as_vllm["old1"]]}
    assert {(e.medium, e.locality, e.ownership) for e in batch.events} == {
        ("STORAGE", "LOCAL", OWNERSHIP_OBJECT)  # the residency the tiers report (object_locality's default)
    }
    # Nothing else was sent for this GC (kept chunks included): the next batch is this marker.
    app.state.events.publish_removed([keys["young"]])
    _, seq, marker = kv_subscriber.next()
    assert seq == 1 and marker.events[0].block_hashes == [as_vllm["young"]]


class GatedStore(ForwardingStore):
    """The node's real store, whose pin-manifest reads and chunk batch deletes wait until their gate opens
    (a store that is slow exactly there), counting how many are waiting or done."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.pin_gate, self.delete_gate = threading.Event(), threading.Event()
        self.pin_reads = 0
        self.batches = 0

    @override
    def get(self, key: str) -> bytes | None:
        if key.startswith(PIN_PREFIX):
            self.pin_reads += 1
            assert self.pin_gate.wait(60)
        return self.inner.get(key)

    @override
    def delete_many(self, keys: Sequence[str]) -> None:
        if any(k.endswith(".bin") for k in keys):
            self.batches += 1
            assert self.delete_gate.wait(60)
        self.inner.delete_many(keys)


def _old_chunks(node: Node, n: int) -> list[str]:
    keys = [NS.chunk_key(make_offload_key(i.to_bytes(32, "big"))) for i in range(n)]
    for key in keys:
        node.store.put(key, b"\x00" * 10)
    listed_older_than(node.store, keys, 1.0)  # past the zero grace period below (stretched by a second)
    return keys


def test_post_gc_answers_at_once_and_the_job_reads_the_pins(node: Node) -> None:
    keys = _old_chunks(node, 6)
    for i in range(5):
        create_pin(node.store, f"p{i}", NS, [keys[i]])
    gated = GatedStore(node.store)
    gated.delete_gate.set()
    node.store = gated  # reading a pin manifest now waits until the test says so
    client = TestClient(make_app(node))
    started = client.post("/v1/gc", json={"ttl_seconds": 0, "grace_seconds": 0})
    assert started.status_code == 202  # answered while no manifest can be read: the request read none
    wait_for(lambda: gated.pin_reads >= 1, what="the job to read the pins")
    assert client.get(f"/v1/jobs/{started.json()['id']}").json()["status"] == "running"
    gated.pin_gate.set()
    job = wait_job(client, started.json()["id"])
    assert job["status"] == "done", job
    assert job["result"]["pin_manifests"] == 5 and job["result"]["kept_pinned"] == 5
    assert job["result"]["deleted"] == 1 and node.store.get(keys[5]) is None


def test_delete_job_cancels_a_running_gc(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc_module, "DELETE_BATCH", 5)
    keys = _old_chunks(node, 60)
    gated = GatedStore(node.store)  # twelve batches of five; the first waits inside its delete
    gated.pin_gate.set()
    node.store = gated
    client = TestClient(make_app(node))
    job_id = client.post("/v1/gc", json={"ttl_seconds": 0, "grace_seconds": 0}).json()["id"]
    wait_for(lambda: gated.batches >= 1, what="the first delete batch")
    cancelled = client.delete(f"/v1/jobs/{job_id}")
    assert cancelled.status_code == 202 and cancelled.json()["status"] == "cancelling"
    gated.delete_gate.set()
    job = wait_job(client, job_id)
    assert job["status"] == "cancelled" and "cancelled" in job["error"]
    # The batch under way finished; none was started after the cancel.
    assert gated.batches == 1 and sum(node.store.exists_many(keys)) == len(keys) - 5
    # The run released its lease: the next GC starts and finishes the work.
    again = wait_job(client, client.post("/v1/gc", json={"ttl_seconds": 0, "grace_seconds": 0}).json()["id"])
    assert again["status"] == "done" and not any(node.store.exists_many(keys))
    # Cancelling a finished or unknown job.
    assert client.delete(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
    assert client.delete("/v1/jobs/nope").status_code == 404
