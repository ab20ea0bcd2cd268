"""An agent started by an engine sees the node as every engine on it does: paths made absolute before they
cross to it (it runs in /), one store for the whole node (an engine or agent configured for another is
refused, saying which), and with the embedded store, whichever server runs now. Real processes, real S3."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvstore.agent.main import EXIT_MISMATCH, run_agent
from kvstore.agent.supervisor import stop_agent
from kvstore.config import Settings, load_settings
from kvstore.metrics import EngineMetrics
from kvstore.node.agent_files import agent_status
from kvstore.node.engines import StoreMismatch
from kvstore.runtime import Node, open_node
from tests.engine_helpers import keys, payload
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _open(settings: Settings, mode: Any = "spawn") -> Node:
    return open_node(settings, metrics=EngineMetrics(CollectorRegistry()), agent=mode)


def test_relative_paths_and_config_file_reach_the_agent_whole(
    tmp_path: Path, s3_server: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative cache_dir once became /<name> in the agent (its working directory is /), and a relative
    KVSTORE_CONFIG_FILE killed it at start, every 30 s."""
    monkeypatch.chdir(tmp_path)
    config = {
        "store_url": f"s3://{s3_bucket}",
        "s3_endpoint": s3_server.endpoint,
        "access_key": s3_server.access_key,
        "secret_key": s3_server.secret_key,
        "cache_dir": "relative-nvme",
        "data_dir": "relative-data",
        "cache_bytes": 1 << 30,
        "pin_sync_s": 0,
    }
    Path("kvstore.json").write_text(json.dumps(config))
    monkeypatch.setenv("KVSTORE_CONFIG_FILE", "kvstore.json")
    node = _open(load_settings())
    try:
        wait_for(lambda: agent_status(tmp_path / "relative-nvme").running, what="the agent, on that cache")
        names = keys(3, "relative")
        assert node.engine.store_many([(k, payload(i)) for i, k in enumerate(names)]).written == 3
        wait_for(lambda: all(node.store.exists_many(names)), timeout=60, what="its uploads")
    finally:
        node.close()
        stop_agent(tmp_path / "relative-nvme", timeout_s=5)


def test_an_engine_or_agent_of_another_store_on_the_cache_is_refused(
    settings: Settings, open_engine_node: Callable[..., Node], s3_server: Any
) -> None:
    """Two engines on one cache_dir with different buckets: the second's chunks once went to the first's
    bucket (the agent's), and its pins were removed by pin sync."""
    other = settings.model_copy(update={"store_url": "s3://another-bucket"})
    first = open_engine_node("none")
    with pytest.raises(StoreMismatch) as refused:
        _open(other, "none")
    message = str(refused.value)
    assert "s3://another-bucket" in message and settings.local_store_url in message
    assert "cache_dir" in message
    assert run_agent(other) == EXIT_MISMATCH, "an agent for another store exits, saying why"
    assert not agent_status(settings.cache_dir).running

    first.close()
    open_engine_node("spawn")  # its agent serves the first store...
    wait_for(lambda: agent_status(settings.cache_dir).store is not None, what="the agent to run")
    with pytest.raises(StoreMismatch, match="node agent"):
        _open(other, "none")  # ...and would upload this engine's chunks there


def test_the_agent_follows_the_embedded_server(tmp_path: Path) -> None:
    """The embedded server belongs to the engine that started it; the agent that engine started outlived it
    and PUT to its dead endpoint for good, while the next engine's server waited for uploads."""
    settings = load_settings(
        cache_dir=str(tmp_path / "nvme"),
        data_dir=str(tmp_path / "data"),
        cache_bytes=1 << 30,
        pin_sync_s=0,
    )
    assert settings.stores == [], "the embedded server"
    first = _open(settings)
    try:
        before = keys(3, "first-server")
        assert first.engine.store_many([(k, payload(i)) for i, k in enumerate(before)]).written == 3
        wait_for(lambda: all(first.store.exists_many(before)), timeout=60, what="the first uploads")
        assert first.embedded is not None
        endpoint = first.embedded.endpoint
    finally:
        first.close()  # stops the server it started
    second = _open(settings)
    try:
        assert second.embedded is not None and second.embedded.endpoint != endpoint, "another server"
        after = keys(3, "second-server")
        assert second.engine.store_many([(k, payload(i)) for i, k in enumerate(after)]).written == 3
        wait_for(lambda: all(second.store.exists_many(after)), timeout=90, what="uploads to the new server")
        assert all(second.store.exists_many(before)), "one bucket: the first uploads are there too"
    finally:
        second.close()
        stop_agent(settings.cache_dir, timeout_s=10)
