"""The admin app against a real node: a real S3 server and a real NVMe cache."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvstore.admin.app import create_app
from kvstore.cache import NVMeCache
from kvstore.keys import Namespace, make_offload_key
from kvstore.pins import create_pin, delete_pin
from kvstore.runtime import Node
from tests.helpers import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def node(private_s3_server: Any, private_s3_store: Any, open_test_node: Callable[..., Node]) -> Node:
    return open_test_node(
        private_s3_server, f"s3://{private_s3_store.bucket}", cache_bytes=10 << 20, outage_cooldown_s=0.1
    )


def test_healthz_and_metrics(node: Node, private_s3_server: Any) -> None:
    client = TestClient(create_app(node))
    node.engine.store_many([("ns_r0/abc/de_g0/1.bin", b"\x01" * 4096)])
    assert node.flush(10)
    health = client.get("/healthz")
    assert health.status_code == 200
    body = health.json()
    assert body["ok"] and body["store"]["ok"] and body["cache"]["entries"] == 1
    assert private_s3_server.secret_key not in health.text
    metrics = client.get("/metrics").text
    assert 'kvstore:write_bytes_total{tier="nvme"}' in metrics
    assert "kvstore:nvme_budget_bytes 1.048576e+07" in metrics

    private_s3_server.stop()
    # The store is checked in the background, a result at most two seconds old: wait for it to notice.
    deadline = time.monotonic() + 30
    while (down := client.get("/healthz")).status_code != 503:
        assert time.monotonic() < deadline, "health never noticed the stopped store"
        time.sleep(0.2)
    assert down.json()["store"]["ok"] is False and down.json()["cache"]["ok"] is True


@pytest.fixture
def freeze(private_s3_server: Any) -> Iterator[Callable[[bool], None]]:
    """freeze(True) stops the node's S3 server with SIGSTOP (it keeps accepting connections, never answers);
    freeze(False) lets it go on."""
    yield private_s3_server.freeze
    private_s3_server.freeze(False)


def test_health_and_stats_answer_within_two_seconds_of_a_frozen_store(
    node: Node, freeze: Callable[[bool], None]
) -> None:
    client = TestClient(create_app(node))
    assert client.get("/healthz").status_code == 200
    assert client.get("/v1/stats").json()["store"]["reachable"] is True
    freeze(True)
    slowest = 0.0
    deadline = time.monotonic() + 30
    unhealthy = False
    while time.monotonic() < deadline and not unhealthy:  # the store's own deadlines are 5-11 s
        began = time.monotonic()
        health = client.get("/healthz")
        stats = client.get("/v1/stats")
        slowest = max(slowest, time.monotonic() - began)
        unhealthy = health.status_code == 503 and stats.json()["store"]["reachable"] is False
    assert unhealthy, "health and stats kept reporting a frozen store as fine"
    assert "no answer" in health.json()["store"]["error"] and "used_bytes" in stats.json()["nvme"]
    for _ in range(5):  # every answer, not only the first: one check in flight, never one per request
        began = time.monotonic()
        assert client.get("/healthz").status_code == 503 and client.get("/v1/stats").status_code == 200
        slowest = max(slowest, time.monotonic() - began)
    assert slowest < 5.0, f"health plus stats took {slowest:.1f} s with the store frozen (it was 81 s)"
    freeze(False)
    deadline = time.monotonic() + 30
    while client.get("/healthz").status_code != 200:
        assert time.monotonic() < deadline, "health did not recover after the store resumed"
        time.sleep(0.2)


# -- what the README promises about the service, on the shared S3 server


@pytest.fixture
def shared_node(s3_server: Any, s3_bucket: str, open_test_node: Callable[..., Node]) -> Node:
    return open_test_node(
        s3_server, f"s3://{s3_bucket}", cache_bytes=10 << 20, admin_token="tok", pin_sync_s=0.2
    )


def test_metrics_and_healthz_stay_open_when_a_token_is_set(shared_node: Node) -> None:
    client = TestClient(create_app(shared_node))
    assert client.get("/v1/pins").status_code == 401
    assert client.get("/healthz").status_code == 200
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "kvstore:nvme_budget_bytes" in metrics.text


def test_healthz_is_503_when_the_cache_is_down(shared_node: Node) -> None:
    # The service's own handle on the node's cache (a second instance over the same index), so that closing
    # it leaves the engine's handle, and the fixture's shutdown, alone.
    settings = shared_node.settings
    cache = NVMeCache(settings.cache_dir, settings.cache_bytes)
    client = TestClient(create_app(dataclasses.replace(shared_node, cache=cache)))
    assert client.get("/healthz").status_code == 200
    cache.close()  # what a service whose cache became unusable has
    down = client.get("/healthz")
    assert down.status_code == 503, down.text
    assert down.json()["cache"]["ok"] is False and down.json()["store"]["ok"] is True


def test_the_service_syncs_pins_made_elsewhere_while_it_runs(shared_node: Node) -> None:
    ns = Namespace(model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16")
    key = ns.chunk_key(make_offload_key(b"\x07" * 32))
    app = create_app(shared_node)

    def sync_loops() -> int:
        return sum(t.name == "kvstore-pin-sync" for t in threading.enumerate())

    before = sync_loops()
    with TestClient(app):  # enters the app's lifespan, which runs the pin sync every pin_sync_s
        create_pin(shared_node.store, "elsewhere", ns, [key])  # as the CLI or another node would
        wait_for(lambda: shared_node.cache.pinned(key) > 0, what="the pin to reach this node's cache")
        delete_pin(shared_node.store, "elsewhere")
        wait_for(lambda: shared_node.cache.pinned(key) == 0, what="the unpin to reach this node's cache")
        assert sync_loops() == before + 1
    assert sync_loops() == before, "the lifespan's end stops the loop"
