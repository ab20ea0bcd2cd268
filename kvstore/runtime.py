"""Open a node from settings: its storage (`kvstore.storage`: the object store, embedded if none is
configured, and the NVMe cache), the engine, and the node agent's part in it. The CLI, the admin service and
the vLLM tier all start here, so they agree on every name."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from kvstore.agent.node_agent import AgentAlreadyRunning, NodeAgent
from kvstore.agent.supervisor import spawn_agent
from kvstore.agent.uploads import wait_uploaded
from kvstore.cache import NVMeCache
from kvstore.config import Settings
from kvstore.engine import EngineThreads, TieredStore
from kvstore.errors import StoreUnavailable
from kvstore.metrics import EngineMetrics
from kvstore.node.engines import check_agreement, store_identity
from kvstore.node.watch import AgentWatch, kill_if_hung
from kvstore.storage import open_cache, open_object_store
from kvstore.stores import ObjectStore
from kvstore.stores.embedded import SeaweedServer

log = logging.getLogger(__name__)

# How the node's background work gets done for a node opened here: "spawn" (the vLLM tier: make sure an
# agent process runs, starting one if needed), "host" (run the agent in this process unless one runs
# already: the admin service, tools that store, tests), "none" (nothing: read-only tools).
AgentMode = Literal["spawn", "host", "none"]
# An agent an engine started exits once no engine has used the cache this long and nothing waits.
SPAWNED_AGENT_IDLE_EXIT_S = 30.0


@dataclass
class Node:
    """What one process holds open: the store, the cache, the engine, the agent it hosts (if any), and the
    embedded server (if any)."""

    settings: Settings
    store: ObjectStore
    cache: NVMeCache
    engine: TieredStore
    embedded: SeaweedServer | None = None
    agent: NodeAgent | None = None
    _closed: bool = False

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the node's upload journal is empty (the agent uploads it); False on timeout."""
        return wait_uploaded(self.cache, timeout)

    def close(self) -> None:
        """Close everything (idempotent). Chunks still waiting for upload stay in the journal."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        if self.agent is not None:
            self.agent.stop()
        self.cache.close()
        self.store.close()
        if self.embedded is not None:
            self.embedded.stop()


def open_node(
    settings: Settings,
    *,
    metrics: EngineMetrics | None = None,
    check_store: bool = True,
    element_width: int = 2,
    agent: AgentMode = "host",
) -> Node:
    """Open store, cache and engine, and see to the node agent as ``agent`` says (see `AgentMode`).
    `element_width` is the KV dtype's size in bytes (the zstd codec's byte-shuffle width; the vLLM tier
    passes its namespace's).

    `check_store=False` tolerates an unreachable store (the vLLM tier must start and serve from NVMe or
    recompute while S3 is down); bad credentials or a missing bucket still fail."""
    metrics = metrics or EngineMetrics.for_registry()
    if agent == "spawn" and settings.local_store_url.startswith("memory://"):
        agent = "host"  # a memory:// store lives in this process: so must the agent that uploads to it
    identity = store_identity(settings)
    # Before anything starts: an engine of another store on this cache is a configuration error.
    check_agreement(settings.cache_dir, identity, what="this engine")
    if agent == "spawn":
        # One stopped inside a write transaction would keep this engine from opening the index at all.
        kill_if_hung(settings.cache_dir)
    store, server = open_object_store(settings, metrics=metrics)
    try:
        try:
            store.check()
        except StoreUnavailable as exc:
            if check_store:
                raise
            log.warning("object store unreachable at start-up, continuing without it for now: %s", exc)
        cache = open_cache(settings)
    except BaseException:
        store.close()
        if server is not None:
            server.stop()
        raise
    hosted = _host_agent(settings, cache, store, metrics, identity) if agent == "host" else None
    watch = None
    if agent == "spawn":
        watch = AgentWatch(
            settings.cache_dir,
            start=lambda: spawn_agent(settings, exit_when_idle_s=SPAWNED_AGENT_IDLE_EXIT_S),
        )
    elif agent == "host":
        watch = AgentWatch(settings.cache_dir)
    try:
        engine = _engine(settings, store, cache, metrics, element_width, watch, hosted, identity)
    except BaseException:
        if hosted is not None:
            hosted.stop()
        cache.close()
        store.close()
        if server is not None:
            server.stop()
        raise
    if watch is not None:
        watch.check()  # in spawn mode: the first engine on the node starts the agent now
    return Node(
        settings=settings,
        store=store,
        cache=cache,
        engine=engine,
        embedded=server,
        agent=hosted,
    )


def _engine(
    settings: Settings,
    store: ObjectStore,
    cache: NVMeCache,
    metrics: EngineMetrics,
    element_width: int,
    watch: AgentWatch | None,
    hosted: NodeAgent | None,
    identity: str,
) -> TieredStore:
    return TieredStore(
        store,
        cache,
        threads=_threads(settings),
        codec=settings.codec,
        element_width=element_width,
        load_timeout_s=settings.load_timeout_s,
        probe_hit_ttl_s=settings.probe_hit_ttl_s,
        probe_miss_ttl_s=settings.probe_miss_ttl_s,
        outage_cooldown_s=settings.outage_cooldown_s,
        prefetch_bytes=settings.prefetch_bytes,
        metrics=metrics,
        agent=watch,
        # A process that hosts the agent writes its figures to the index itself; the agent shares its
        # metrics and publishes none of its own.
        counters_sink=cache.add_counters if hosted is not None else None,
        store_identity=identity,
    )


def _threads(settings: Settings) -> EngineThreads:
    return EngineThreads(
        io_workers=settings.io_workers,
        disk_workers=settings.disk_workers,
        upload_workers=settings.upload_workers,
    )


def _host_agent(
    settings: Settings, cache: NVMeCache, store: ObjectStore, metrics: EngineMetrics, identity: str
) -> NodeAgent | None:
    """The node agent, run by this process unless another process already runs it."""
    agent = NodeAgent.for_settings(
        settings,
        cache,
        store,
        metrics,
        idle_priority=False,
        publish_counters=False,
        store_identity=identity,
    )
    try:
        agent.start(wait_s=0.5)
    except AgentAlreadyRunning:
        log.info("a node agent already runs for %s: this process hosts none", settings.cache_dir)
        agent.stop(0)
        return None
    return agent


@contextlib.contextmanager
def node(
    settings: Settings, *, metrics: EngineMetrics | None = None, agent: AgentMode = "host"
) -> Iterator[Node]:
    opened = open_node(settings, metrics=metrics, agent=agent)
    try:
        yield opened
    finally:
        opened.close()
