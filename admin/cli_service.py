"""`kvstore serve` (the admin service) and `kvstore demo` (the whole stack on one machine)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from kvstore.admin.cli_common import (
    EXIT_CONFIG,
    EXIT_UNAVAILABLE,
    console,
    node_or_exit,
    say,
    settings_or_exit,
)
from kvstore.errors import KVStoreError

__all__ = ["demo", "serve"]


def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="Port, 1-65535 (default 8750)")] = None,
    insecure_no_auth: Annotated[
        bool,
        typer.Option(
            "--insecure-no-auth",
            help="Serve /v1 without a token on a non-loopback address: anyone who reaches it can run GC",
        ),
    ] = False,
    agent: Annotated[
        bool,
        typer.Option(
            help="Run the node agent in this process when none runs yet (--no-agent: `kvstore agent` runs it)"
        ),
    ] = True,
) -> None:
    """Run the admin service (health, metrics) and, unless one already runs, the node agent. Starts a local
    S3 server if none is configured."""
    import uvicorn

    from kvstore.admin.app import create_app
    from kvstore.admin.auth import is_loopback

    settings = settings_or_exit(admin_host=host, admin_port=port)
    if settings.admin_token is None and not is_loopback(settings.admin_host):
        if not insecure_no_auth:
            say(
                f"refusing to serve the admin API on {settings.admin_host!r} without a token",
                "anyone who reaches it could pin, warm and garbage-collect. Set KVSTORE_ADMIN_TOKEN, bind to "
                "127.0.0.1, or pass --insecure-no-auth if something else guards the network.",
            )
            raise typer.Exit(EXIT_CONFIG)
        say(
            "warning",
            f"the /v1 API on {settings.admin_host!r} accepts requests from anyone (--insecure-no-auth)",
            style="yellow",
        )
    node = node_or_exit(settings, "cannot start", agent="host" if agent else "none")
    try:
        if node.embedded is not None:
            console.print(
                f"embedded S3 server: [bold]{escape(node.embedded.endpoint)}[/bold] "
                f"(bucket kvstore, data in {escape(str(settings.data_dir / 's3'))}, "
                f"credentials in {escape(str(settings.data_dir / 's3' / 'credentials.json'))})"
            )
        cache = f"NVMe cache: {settings.cache_dir} (budget {settings.cache_bytes:,} bytes)"
        console.print(cache, markup=False)
        console.print(
            f"admin API: http://{settings.admin_host}:{settings.admin_port}  (/healthz, /metrics, /docs)",
            markup=False,
        )
        uvicorn.run(create_app(node), host=settings.admin_host, port=settings.admin_port, log_level="warning")
    finally:
        node.close()


def demo(
    conversations: Annotated[int, typer.Option(min=1, help="Conversations in the replay")] = 6,
    turns: Annotated[int, typer.Option(min=2, help="Turns per conversation")] = 3,
    hold: Annotated[bool, typer.Option(help="Keep everything running after the report, until Ctrl-C")] = True,
) -> None:
    """Start S3 (embedded), the admin service and vLLM with our tier; replay a multi-turn chat; report."""
    from kvstore.connector.demo.view import show_demo
    from kvstore.connector.harness.vllm_server import VLLMServerError

    try:
        show_demo(settings_or_exit(), console, conversations=conversations, turns=turns, hold=hold)
    except (KVStoreError, VLLMServerError) as exc:
        say("demo failed", exc)
        raise typer.Exit(EXIT_UNAVAILABLE) from None
