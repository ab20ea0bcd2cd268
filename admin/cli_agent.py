"""`kvstore agent`: run the node agent for this node's cache directory (one per node: a DaemonSet container,
a systemd unit), and `kvstore agent --status` / `--stop`."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from kvstore.admin.cli_common import EXIT_UNAVAILABLE, console, say, settings_or_exit
from kvstore.errors import KVStoreError

__all__ = ["agent"]


def agent(
    metrics_port: Annotated[
        int | None, typer.Option(min=1, max=65535, help="Serve the agent's Prometheus metrics on this port")
    ] = None,
    metrics_host: Annotated[str, typer.Option(help="Address of the metrics endpoint")] = "127.0.0.1",
    status: Annotated[bool, typer.Option("--status", help="Say whether an agent runs here; exit")] = False,
    stop: Annotated[bool, typer.Option("--stop", help="Stop the agent that runs here, then exit")] = False,
) -> None:
    """Run the node agent: uploads, admission of object hits to NVMe, eviction, access records, pin sync,
    at idle CPU and I/O priority, for every vLLM engine on this node (`cache_dir`). Without one, the first
    engine starts one itself (tier option `agent: auto`)."""
    from kvstore.agent.main import run_agent
    from kvstore.agent.supervisor import agent_status, stop_agent

    settings = settings_or_exit()
    if status or stop:
        found = agent_status(settings.cache_dir)
        console.print(f"node agent for {settings.cache_dir}: {found.describe()}")
        if stop and found.running and not stop_agent(settings.cache_dir):
            say("could not stop the agent", found.describe())
            raise typer.Exit(EXIT_UNAVAILABLE)
        return
    logging.getLogger("kvstore").setLevel(logging.INFO)
    try:
        # Another agent on this directory (one an engine started, the admin service's): wait for it to go.
        code = run_agent(settings, metrics_port=metrics_port, metrics_host=metrics_host, wait_for_lock=True)
    except KVStoreError as exc:
        say("agent failed", exc)
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    if code:  # another store than the engines' on this cache, or stopped on an error: said in the log
        raise typer.Exit(code)
