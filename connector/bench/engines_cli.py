"""`kvstore bench vllm`: its options, the TTFT and scheduler-cost runs (`engines`), its table and lines."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.admin.cli_common import console, settings_or_exit
from kvstore.connector.bench.command import (
    BUCKET_MB_S_HELP,
    BUCKET_RTT_MS_HELP,
    CHUNK_TOKENS_HELP,
    bench_command,
    bench_options,
    chunk_tokens_or_exit,
    link_or_exit,
    link_said,
    option,
    progress,
    refuse,
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
    methods: str = option(
        default="recompute,fs,ours-nvme,ours-bucket,obj",
        help="TTFT methods in the order they run (rotate it between runs): recompute, fs, ours-nvme, "
        "ours-bucket (a new node), obj (vLLM's object tier); recompute and fs are the baselines",
    )
    chunk_tokens: int = option(default=0, help=CHUNK_TOKENS_HELP)
    bucket_rtt_ms: float = option(default=0.0, help=BUCKET_RTT_MS_HELP)
    bucket_mb_s: float = option(default=0.0, help=BUCKET_MB_S_HELP)
    steps: int = option(default=200, help="Scheduler steps for the overhead measurement")
    output: Path = option(default=Path("bench-results/vllm.json"), help="JSON results file")


# The scheduler-thread cost is measured at each of these: (seconds between steps, loads as well as stores).
_SCHEDULER_RUNS = ((0.0, True), (0.02, True), (0.02, False))


@bench_command("vllm", VLLMOptions)
def bench_vllm(o: VLLMOptions) -> None:
    """TTFT: recompute vs vLLM's fs tier vs our tier (NVMe hit, object only) vs vLLM's obj tier, with a new
    node's timeline and the S3 requests per chunk; scheduler-thread cost."""
    from kvstore.connector.bench.engines import TTFT_METHODS, bench_scheduler, bench_ttft
    from kvstore.connector.bench.target import bench_target, environment

    methods = [m.strip() for m in o.methods.split(",") if m.strip()]
    if any(m not in TTFT_METHODS for m in methods) or not {"recompute", "fs"} <= set(methods):
        refuse("bad --methods", f"{o.methods!r}: recompute and fs, and any of {', '.join(TTFT_METHODS)}")
    link = link_or_exit(o.bucket_rtt_ms, o.bucket_mb_s)
    with bench_target(settings_or_exit(), "vllm", link) as target:
        report = bench_ttft(
            target,
            words=o.words,
            prompts=o.prompts,
            methods=methods,
            progress=progress,
            chunk_tokens=chunk_tokens_or_exit(o.chunk_tokens),
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
        f"kvstore bench vllm: TTFT of a {report.prompt_tokens}-token prompt in {report.chunk_tokens}-token "
        f"chunks (median of {report.prompts}, tiny model, CPU backend; page cache dropped before each "
        f"engine: tier files{', S3 objects' if report.s3_objects_cold else ''}"
        f"{link_said(report.link)})",
        ("method", "TTFT s", "cached tokens", "speed-up vs recompute", "vs fs tier", "S3 GET/chunk",
         "GET 404", "PUT", "$ per 1M chunks"),
    )  # fmt: skip
    for row in report.rows:
        per = row.gets_per_chunk
        ttft.add_row(
            row.method,
            f"{row.ttft_s:.3f}",
            str(row.cached_tokens),
            f"{row.speedup_vs_recompute:.1f}x",
            f"{row.vs_fs_tier:.2f}x",
            "-" if per is None else f"{per:.2f}",
            "-" if row.s3_get_missing is None else f"{row.s3_get_missing:.0f}",
            "-" if row.s3_put is None else f"{row.s3_put:.0f}",
            "-" if row.usd_per_million_chunks is None else f"{row.usd_per_million_chunks:.2f}",
        )
    console.print(ttft)
    if report.timeline:
        phases = table(
            "Where a new node's request went (median of the prompts; CPU of the whole engine process)",
            ("phase", "from ms", "to ms", "took ms", "CPU ms"),
        )
        for phase in report.timeline:
            phases.add_row(
                phase.name,
                f"{phase.start_ms:.1f}",
                f"{phase.end_ms:.1f}",
                f"{phase.end_ms - phase.start_ms:.1f}",
                f"{phase.cpu_ms:.1f}",
            )
        console.print(phases)
        c = report.timeline_counts
        console.print(
            f"per request: {c.get('step', 0):.0f} scheduler steps ({c.get('idle_wait', 0):.0f} of them idle, "
            f"waiting for the tier), {c.get('lookup', 0):.0f} lookups of our tier, "
            f"{c.get('get_returned', 0):.0f} GETs, {c.get('load_submitted', 0):.0f} promotion jobs"
        )
    for s in report.scheduler:
        pacing = f"{s.step_interval_ms:.0f} ms between steps" if s.step_interval_ms else "steps back to back"
        work = "stores and loads" if s.loads_every_step else "stores only"
        console.print(
            f"scheduler thread ({pacing}, {work}): {s.mean_ms_per_step:.3f} ms/step mean "
            f"({s.cpu_ms_per_step:.3f} ms of its own CPU, the rest waiting for the GIL), "
            f"{s.p99_ms_per_step:.3f} ms p99 over {s.steps} steps, "
            f"up to {s.max_in_flight_chunks} chunks in flight"
        )
