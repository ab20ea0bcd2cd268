"""Fixtures of the engine's and the agent's tests: an engine over a real cache, and the node agent."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvstore.agent.node_agent import NodeAgent
from kvstore.cache import NVMeCache
from kvstore.chunk import HEADER_BLOCK
from kvstore.engine import EngineThreads, TieredStore
from kvstore.metrics import EngineMetrics
from kvstore.stores import ObjectStore
from tests.engine_helpers import CHUNK


@pytest.fixture
def metrics() -> EngineMetrics:
    return EngineMetrics(CollectorRegistry())


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[NVMeCache]:
    with NVMeCache(tmp_path / "nvme", budget_bytes=64 * (CHUNK + HEADER_BLOCK)) as c:
        yield c


@pytest.fixture
def make_engine() -> Iterator[Callable[..., TieredStore]]:
    """Engines over a cache (and a store, or None for NVMe only); every one is closed at the end."""
    made: list[TieredStore] = []

    def make(
        store: ObjectStore | None,
        cache: NVMeCache,
        metrics: EngineMetrics,
        *,
        io_workers: int = 16,
        cooldown: float = 1.0,
        **kwargs: Any,
    ) -> TieredStore:
        threads = EngineThreads(io_workers=io_workers, disk_workers=4, upload_workers=1)
        engine = TieredStore(
            store, cache, metrics=metrics, threads=threads, outage_cooldown_s=cooldown, **kwargs
        )
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@pytest.fixture
def start_agent() -> Iterator[Callable[..., NodeAgent]]:
    """The node agent of a cache, in this process (normal priority); every one is stopped at the end."""
    started: list[tuple[NodeAgent, EngineThreads]] = []

    def start(
        cache: NVMeCache,
        store: ObjectStore | None,
        metrics: EngineMetrics | None = None,
        *,
        cooldown: float = 1.0,
        upload_workers: int = 4,
        **kwargs: Any,
    ) -> NodeAgent:
        threads = EngineThreads(io_workers=4, disk_workers=2, upload_workers=upload_workers)
        agent = NodeAgent(
            cache,
            store,
            metrics=metrics or EngineMetrics(CollectorRegistry()),
            threads=threads,
            outage_cooldown_s=cooldown,
            pin_sync_s=0,
            idle_priority=False,
            **kwargs,
        )
        agent.start()
        started.append((agent, threads))
        return agent

    yield start
    for agent, threads in started:
        agent.stop()
        threads.join(10)
