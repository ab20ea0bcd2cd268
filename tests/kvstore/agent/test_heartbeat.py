"""A healthy agent beats: the next agent to start replaces one that holds the lock but has not beaten for
two minutes (and is not even runnable), so an idle agent that stopped beating would one day be killed as
hung."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvstore.agent.node_agent import NodeAgent
from kvstore.agent.supervisor import STATUS_NAME, agent_status
from kvstore.cache import NVMeCache
from tests.helpers import wait_for


def test_an_idle_agent_keeps_beating(cache: NVMeCache, start_agent: Callable[..., NodeAgent]) -> None:
    start_agent(cache, None)  # nothing to upload, nothing to evict: idle
    status = Path(cache.directory) / STATUS_NAME
    assert agent_status(cache.directory).running
    first = status.stat().st_mtime_ns
    wait_for(lambda: status.stat().st_mtime_ns > first, what="a heartbeat (the status file's mtime moving)")
    assert not agent_status(cache.directory).hung
