"""The admin app against a real node: a real S3 server and a real NVMe cache."""

from __future__ import annotations

from collections.abc import Callable
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
    down = client.get("/healthz")
    assert down.status_code == 503
    assert down.json()["store"]["ok"] is False and down.json()["cache"]["ok"] is True
