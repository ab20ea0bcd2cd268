"""`kvstore bench gc`: its options, the run in a prefix of its own, its JSON."""

from __future__ import annotations

import json
from pathlib import Path

from kvstore.admin.cli_common import console, settings_or_exit, store_or_exit
from kvstore.connector.bench.command import bench_command, bench_options, option, write_results

__all__ = ["GCOptions", "bench_gc"]


@bench_options
class GCOptions:
    objects: int = option(default=200_000, help="Chunk objects to generate")
    output: Path = option(default=Path("bench-results/gc.json"), help="JSON results file")


@bench_command("gc", GCOptions)
def bench_gc(o: GCOptions) -> None:
    """GC over a generated bucket in a private prefix (removed afterwards): wall time, objects/s, peak RSS."""
    import time

    from kvstore.connector.bench.gc import run_gc_bench

    # A prefix of its own: the GC under test must only ever see the objects this benchmark generated.
    with store_or_exit(
        settings_or_exit(), "benchmark failed", subprefix=f"bench-gc-{time.time_ns()}"
    ) as store:
        store.check()
        result = run_gc_bench(store, o.objects)
        store.delete_many([info.key for info in store.list()])
    console.print_json(json.dumps(result))
    write_results(o.output, json.dumps(result, indent=2))
