"""`kvstore bench`: the benchmarks' commands, assembled. Each is declared beside its benchmark (`<name>_cli`,
the way `command` describes) and runs against a store prefix of its own (the configured store, or the
embedded server when none is configured), deleted at the end."""

from __future__ import annotations

import typer

from kvstore.connector.bench.engines_cli import bench_vllm
from kvstore.connector.bench.fleet_cli import bench_fleet
from kvstore.connector.bench.gc_cli import bench_gc
from kvstore.connector.bench.multiturn_cli import bench_multiturn
from kvstore.connector.bench.offered_cli import bench_offered
from kvstore.connector.bench.tiers_cli import bench_tiers

__all__ = ["COMMANDS", "bench_app"]

# In this order in `kvstore bench --help`.
COMMANDS = (bench_gc, bench_tiers, bench_offered, bench_vllm, bench_multiturn, bench_fleet)

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that compare against a baseline in one run.")
for _command in COMMANDS:
    _command.register(bench_app)
