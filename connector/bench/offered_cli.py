"""`kvstore bench offered`: its options, the runs at fixed rates (`offered`), its table and memory lines."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.admin.cli_common import console, finite_seconds
from kvstore.connector.bench.command import (
    bench_command,
    bench_options,
    option,
    progress,
    table,
    write_results,
)

if TYPE_CHECKING:
    from kvstore.connector.bench.offered import OfferedReport

__all__ = ["OfferedOptions", "bench_offered"]


@bench_options
class OfferedOptions:
    rates: str = option(default="0.25,0.5,1,2", help="Offered store rates, GB/s, comma separated")
    seconds: float = option(default=10.0, help="How long each rate is offered")
    chunk_kib: int = option(default=2048, help="Chunk size, KiB")
    primary_mib: int = option(default=1024, help="Primary-tier rows for stores in flight, MiB")
    memory_gib: float = option(default=4, help="GiB each tier stores for the memory figures (0: skip)")
    output: Path = option(default=Path("bench-results/offered.json"), help="JSON results file")


@bench_command("offered", OfferedOptions)
def bench_offered(o: OfferedOptions) -> None:
    """Stores offered at fixed rates through vLLM's tier API, ours and vLLM's fs tier: what is persisted,
    what is dropped and why, the scheduler's time per step; then page cache and RSS growth."""
    from kvstore.connector.bench.offered import run_offered_bench

    finite_seconds("--seconds", o.seconds, positive=True)
    chunk = o.chunk_kib * 1024
    report = run_offered_bench(
        chunk_bytes=chunk,
        rows=max(16, (o.primary_mib << 20) // chunk),
        rates=[float(r) * 1e9 for r in o.rates.split(",") if r.strip()],
        seconds=o.seconds,
        memory_bytes=int(o.memory_gib * (1 << 30)),
        progress=progress,
    )
    _print(report, o.chunk_kib)
    write_results(o.output, report.to_json())


def _print(report: OfferedReport, chunk_kib: int) -> None:
    console.print(f"raw disk (O_DIRECT dd write, 2 MiB blocks): {report.dd_write_gb_s:.2f} GB/s")
    runs = table(
        f"stores offered at a fixed rate, {chunk_kib} KiB chunks, {report.rows} primary rows",
        (
            "tier",
            "offered GB/s",
            "persisted NVMe",
            "object store at end",
            "after drain",
            "no free row",
            "failed",
            "uploads lost",
            "step ms mean / p99",
        ),
    )
    for r in report.runs:
        runs.add_row(
            r.tier,
            f"{r.rate_gb_s:.2f}",
            f"{r.persisted_nvme:.1%}",
            "" if r.persisted_object_at_end is None else f"{r.persisted_object_at_end:.1%}",
            "" if r.persisted_object_after_drain is None else f"{r.persisted_object_after_drain:.1%}",
            str(r.dropped_primary_full),
            str(r.failed_jobs_chunks),
            str(r.uploads_lost),
            f"{r.step_ms_mean:.2f} / {r.step_ms_p99:.2f}",
        )
    console.print(runs)
    for m in report.memory:
        console.print(
            f"{m.tier}: {m.stored_gib:.1f} GiB stored, page cache +{m.page_cache_growth_mib:.0f} MiB, "
            f"RSS +{m.rss_growth_mib:.0f} MiB"
        )
