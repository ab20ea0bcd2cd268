"""`kvstore bench vllm`: its options, the TTFT and scheduler-cost runs (`engines`), its table and lines."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.admin.cli_common import console, settings_or_exit
from kvstore.connector.bench.command import (
    bench_command,
    bench_options,
    option,
    progress,
    table,
    write_results,
)

if TYPE_CHECKING:
    from kvstore.connector.bench.engines import VLLMReport

__all__ = ["VLLMOptions", "bench_vllm"]


@bench_options
class VLLMOptions:
    words: int = option(default=5600, help="Prompt length in words (~1.08 tokens each)")
    prompts: int = option(default=3, help="Prompts per engine (TTFT is their median)")
    steps: int = option(default=200, help="Scheduler steps for the overhead measurement")
    output: Path = option(default=Path("bench-results/vllm.json"), help="JSON results file")


# The scheduler-thread cost is measured at each of these: (seconds between steps, loads as well as stores).
_SCHEDULER_RUNS = ((0.0, True), (0.02, True), (0.02, False))


@bench_command("vllm", VLLMOptions)
def bench_vllm(o: VLLMOptions) -> None:
    """TTFT: recompute vs vLLM's fs tier vs our tier (NVMe hit, object only); scheduler-thread cost."""
    from kvstore.connector.bench.engines import bench_scheduler, bench_ttft
    from kvstore.connector.bench.target import bench_target, environment

    with bench_target(settings_or_exit(), "vllm") as target:
        report = bench_ttft(
            target.store_url,
            target.endpoint,
            dict(target.env),
            words=o.words,
            prompts=o.prompts,
            progress=progress,
        )
        progress("scheduler-thread cost")
        with environment(target.env):
            for interval, loads in _SCHEDULER_RUNS:
                report.scheduler.append(
                    bench_scheduler(
                        target.store_url,
                        target.endpoint,
                        steps=o.steps,
                        step_interval_s=interval,
                        loads=loads,
                    )
                )
    _print(report)
    write_results(o.output, report.to_json())


def _print(report: VLLMReport) -> None:
    ttft = table(
        f"kvstore bench vllm: TTFT of a {report.prompt_tokens}-token prompt "
        f"(median of {report.prompts}, tiny model, CPU backend)",
        ("method", "TTFT s", "cached tokens", "speed-up vs recompute", "vs fs tier"),
    )
    for row in report.rows:
        ttft.add_row(
            row.method,
            f"{row.ttft_s:.3f}",
            str(row.cached_tokens),
            f"{row.speedup_vs_recompute:.1f}x",
            f"{row.vs_fs_tier:.2f}x",
        )
    console.print(ttft)
    for s in report.scheduler:
        pacing = f"{s.step_interval_ms:.0f} ms between steps" if s.step_interval_ms else "steps back to back"
        work = "stores and loads" if s.loads_every_step else "stores only"
        console.print(
            f"scheduler thread ({pacing}, {work}): {s.mean_ms_per_step:.3f} ms/step mean "
            f"({s.cpu_ms_per_step:.3f} ms of its own CPU, the rest waiting for the GIL), "
            f"{s.p99_ms_per_step:.3f} ms p99 over {s.steps} steps, "
            f"up to {s.max_in_flight_chunks} chunks in flight"
        )
