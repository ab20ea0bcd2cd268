"""Shared fixtures of the connector tests: no node agent left running after a test (the tiny local model is
the root conftest's `tiny_model`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.agent.supervisor import LOCK_NAME, stop_agent


@pytest.fixture(autouse=True)
def stop_node_agents(tmp_path: Path) -> Iterator[None]:
    """A tier starts a node agent for its cache directory that outlives the engine by design (it uploads
    what the engine stored); a test's cache directories go with the test, and so do their agents."""
    yield
    for lock in tmp_path.rglob(LOCK_NAME):
        stop_agent(lock.parent, timeout_s=10)
