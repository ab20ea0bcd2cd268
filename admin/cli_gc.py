"""`kvstore gc`: garbage-collect the bucket, from cron or by hand.

Which chunks stay is `kvstore.gc`'s decision, the same as for the admin service's `POST /v1/gc`: the bucket's
pin manifests, and the pins of this node's NVMe cache when the node has one (`cache_dir` exists; a machine
without it has no cache pins, and GC creates no cache there).
"""

from __future__ import annotations

import contextlib
import json
from typing import Annotated

import typer

from kvstore.admin.cli_common import (
    EXIT_BUSY,
    EXIT_CONFIG,
    console,
    finite_seconds,
    say,
    settings_or_exit,
    store_or_exit,
)
from kvstore.errors import ConfigError

__all__ = ["gc"]


def gc(
    ttl_seconds: Annotated[float, typer.Option(help="Delete unpinned chunks idle longer than this")] = 7
    * 86400,
    max_bytes: Annotated[
        int | None, typer.Option(help="Then delete oldest-first down to this many bytes")
    ] = None,
    grace_seconds: Annotated[float, typer.Option(help="Never touch objects younger than this")] = 3600,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Report what would be deleted, delete nothing")
    ] = False,
) -> None:
    """Garbage-collect the bucket (run it from cron): TTL, then a byte budget; pinned chunks (the bucket's
    pins and this node's) and young objects stay. With `events_endpoint` set, each deleted batch is published
    as vLLM `BlockRemoved` events."""
    from kvstore.events import open_publisher
    from kvstore.gc import run_gc
    from kvstore.lease import LeaseHeld
    from kvstore.storage import open_cache

    finite_seconds("--ttl-seconds", ttl_seconds)
    finite_seconds("--grace-seconds", grace_seconds)
    if max_bytes is not None and max_bytes < 0:
        say("bad arguments", f"--max-bytes must be >= 0, got {max_bytes}")
        raise typer.Exit(EXIT_CONFIG)
    settings = settings_or_exit()
    try:
        publisher = None if dry_run else open_publisher(settings.events_endpoint)
    except ConfigError as exc:
        say("configuration error", exc)
        raise typer.Exit(EXIT_CONFIG) from None
    with contextlib.ExitStack() as stack, store_or_exit(settings, "GC failed") as store:
        if publisher is not None:
            stack.callback(publisher.close)  # lingers so the last batch still goes out
        try:
            store.check()
            # The node's cache, as its other processes share it (GC only reads its pin counts).
            cache = stack.enter_context(open_cache(settings)) if settings.cache_dir.is_dir() else None
            report = run_gc(
                store,
                ttl_seconds=ttl_seconds,
                max_bytes=max_bytes,
                grace_seconds=grace_seconds,
                dry_run=dry_run,
                cache=cache,
                on_removed=publisher.publish_removed if publisher is not None else None,
            )
        except LeaseHeld as exc:
            say("another GC is running", exc, style="yellow")
            raise typer.Exit(EXIT_BUSY) from None
        except ValueError as exc:
            say("bad arguments", exc)
            raise typer.Exit(EXIT_CONFIG) from None
    console.print_json(json.dumps(report.as_dict()))
