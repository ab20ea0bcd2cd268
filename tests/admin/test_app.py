"""The admin app against a real node: a real S3 server and a real NVMe cache."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from kvstore.admin.app import create_app

from kvstore.runtime import Node


@pytest.fixture
def node(private_s3_server: Any, private_s3_store: Any, open_test_node: Callable[..., Node]) -> Node:
    return open_test_node(
        private_s3_server, f"s3://{private_s3_store.bucket}", cache_bytes=10 << 20, outage_cooldown_s=0.1
    )


def test_healthz_and_metrics(node: Node, private_s3_server: Any) -> None:
    client = TestClient(create_app(node))
    node.engine.store_many([("ns_r0/abc/de_g0/1.bin", b"\x01" * 4096)])
    assert node.engine.flush(10)
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
    pid = private_s3_server._seaweed.pid

    def freeze(on: bool) -> None:
        os.killpg(pid, signal.SIGSTOP if on else signal.SIGCONT)

    yield freeze
    freeze(False)


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
