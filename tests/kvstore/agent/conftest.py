"""Fixtures of the node agent's process tests: settings on a real S3 server, and engines opened on them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvstore.agent.supervisor import stop_agent
from kvstore.config import Settings, load_settings
from kvstore.metrics import EngineMetrics
from kvstore.runtime import Node, open_node


@pytest.fixture
def settings(tmp_path: Path, s3_server: Any, s3_bucket: str) -> Iterator[Settings]:
    made = load_settings(
        store_url=f"s3://{s3_bucket}",
        s3_endpoint=s3_server.endpoint,
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
        cache_dir=str(tmp_path / "nvme"),
        cache_bytes=1 << 30,
        pin_sync_s=0,
    )
    yield made
    stop_agent(made.cache_dir, timeout_s=5)  # whatever a test started


@pytest.fixture
def open_engine_node(settings: Settings) -> Iterator[Callable[..., Node]]:
    opened: list[Node] = []

    def open_(mode: Any = "spawn") -> Node:
        node = open_node(settings, metrics=EngineMetrics(CollectorRegistry()), agent=mode)
        opened.append(node)
        return node

    yield open_
    for node in opened:
        node.close()
