"""Shared fixtures for the vLLM tests: the tiny local model, built once per session, and no node agent left
running after a test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.agent.supervisor import LOCK_NAME, stop_agent
from kvstore.connector.harness.tiny_model import build_tiny_model


@pytest.fixture(autouse=True)
def stop_node_agents(tmp_path: Path) -> Iterator[None]:
    """A tier starts a node agent for its cache directory that outlives the engine by design (it uploads
    what the engine stored); a test's cache directories go with the test, and so do their agents."""
    yield
    for lock in tmp_path.rglob(LOCK_NAME):
        stop_agent(lock.parent, timeout_s=10)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")
