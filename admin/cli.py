"""The `kvstore` command line. Every command calls the same library functions as the admin API.

Exit codes are `cli_common`'s; the benchmarks' commands are `kvstore.connector.bench.cli`.
"""

from __future__ import annotations

import logging
import sys

import typer

from kvstore.admin import cli_agent, cli_gc, cli_node, cli_service
from kvstore.admin.cli_common import EXIT_CONFIG, EXIT_UNAVAILABLE, say
from kvstore.admin.cli_pins import pin_app
from kvstore.connector.bench.cli import bench_app
from kvstore.errors import ConfigError, KVStoreError

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Object-storage-first KV cache for vLLM.")
# One module per command group: the service (cli_service), the node agent (cli_agent), this node (cli_node),
# pins (cli_pins), GC (cli_gc), benchmarks (kvstore.connector.bench.cli).
app.command()(cli_service.serve)
app.command()(cli_service.demo)
app.command()(cli_agent.agent)
app.command()(cli_node.fsck)
app.add_typer(pin_app, name="pin")
app.command()(cli_node.stats)
app.command()(cli_node.warm)
app.command()(cli_node.migrate)
app.command()(cli_gc.gc)
app.add_typer(bench_app, name="bench")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except ConfigError as exc:
        say("configuration error", exc)
        sys.exit(EXIT_CONFIG)
    except KVStoreError as exc:  # a store or cache failure no command translated itself
        say("error", exc)
        sys.exit(EXIT_UNAVAILABLE)
    except OSError as exc:  # e.g. a directory on a read-only or full file system: a message, not a traceback
        say("error", exc)
        sys.exit(EXIT_UNAVAILABLE)


if __name__ == "__main__":
    main()
