"""Running the node agent as a process: `kvstore agent` (an operator's DaemonSet container or systemd unit)
and `python -m kvstore.agent` (what an engine starts when the node has none). Both end in `run_agent`."""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType

from prometheus_client import REGISTRY, start_http_server

from kvstore.agent.embedded_store import FollowedStore
from kvstore.agent.node_agent import AgentAlreadyRunning, NodeAgent
from kvstore.config import Settings
from kvstore.metrics import EngineMetrics
from kvstore.node.engines import StoreMismatch, check_agreement, store_identity
from kvstore.priority import lower_priority
from kvstore.storage import open_cache, open_object_store
from kvstore.stores import ObjectStore

log = logging.getLogger(__name__)

# How often an agent on the embedded store looks for the server that runs now.
_FOLLOW_EVERY_S = 10.0
EXIT_MISMATCH = 2
EXIT_FAILED = 3  # the agent stopped on an error: a service manager restarts it


def run_agent(
    settings: Settings,
    *,
    exit_when_idle_s: float | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    wait_for_lock: bool = False,
) -> int:
    """Run the agent of ``settings.cache_dir`` until SIGTERM/SIGINT (or, with ``exit_when_idle_s``, until no
    engine has used the cache that long and nothing waits for upload). When another agent already runs for
    that directory: with ``wait_for_lock`` (an operator's agent), wait to take over when it goes; without
    (one an engine started), exit at once with status 1. An agent configured for another store than the
    engines on the cache exits with status 2, saying so; one that stopped on an error, with status 3."""
    identity = store_identity(settings)
    try:
        check_agreement(settings.cache_dir, identity, what="this node agent", with_agent=False)
    except StoreMismatch as exc:
        log.error("%s", exc)
        return EXIT_MISMATCH
    lower_priority(whole_process=True)  # the threads libraries started, and every thread started from now on
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    store: ObjectStore
    store, server = open_object_store(settings)
    followed = None
    if server is not None:
        followed = store = FollowedStore(store, server, lambda: open_object_store(settings))
    cache = open_cache(settings)
    metrics = EngineMetrics.for_registry(REGISTRY)
    agent = NodeAgent.for_settings(
        settings, cache, store, metrics, exit_when_idle_s=exit_when_idle_s, store_identity=identity
    )
    try:
        while True:
            try:
                # An engine's agent gives way at once (another engine started one a moment earlier); an
                # operator's waits for the one that runs to go.
                agent.start(wait_s=5.0 if wait_for_lock else 1.0)
                break
            except AgentAlreadyRunning as exc:
                if not wait_for_lock:
                    log.info("%s: nothing to do", exc)
                    return 1
                log.info("%s: waiting to take over when it stops", exc)
                if stop.wait(5.0):
                    return 0
        if metrics_port:
            start_http_server(metrics_port, addr=metrics_host, registry=REGISTRY)
            log.info("agent metrics on http://%s:%d/metrics", metrics_host, metrics_port)
        follow_at = time.monotonic() + _FOLLOW_EVERY_S
        while not stop.is_set() and not agent.wait(0.5):
            if followed is not None and time.monotonic() >= follow_at:
                # This thread lives as long as the process: a server it starts is tied to it.
                followed.follow()
                follow_at = time.monotonic() + _FOLLOW_EVERY_S
        return EXIT_FAILED if agent.failed else 0
    finally:
        agent.stop()
        cache.close()
        store.close()
        if server is not None and followed is None:
            server.stop()
