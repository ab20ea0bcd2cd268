"""Running the node agent as a process: `kvstore agent` (an operator's DaemonSet container or systemd unit)
and `python -m kvstore.agent` (what an engine starts when the node has none). Both end in `run_agent`."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

from prometheus_client import REGISTRY, start_http_server

from kvstore.agent.node_agent import AgentAlreadyRunning, NodeAgent
from kvstore.agent.supervisor import lower_priority
from kvstore.config import Settings
from kvstore.metrics import EngineMetrics
from kvstore.runtime import open_cache, open_object_store

log = logging.getLogger(__name__)


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
    (one an engine started), exit at once with status 1."""
    lower_priority(whole_process=True)  # the threads libraries started, and every thread started from now on
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    store, server = open_object_store(settings)
    cache = open_cache(settings)
    metrics = EngineMetrics.for_registry(REGISTRY)
    agent = NodeAgent.for_settings(settings, cache, store, metrics, exit_when_idle_s=exit_when_idle_s)
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
        while not stop.is_set() and not agent.wait(0.5):
            pass
        return 0
    finally:
        agent.stop()
        cache.close()
        store.close()
        if server is not None:
            server.stop()
