"""`kvstore bench fleet`: its options and their checks, the run (`fleet`), its table, lines, JSON and PNG."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvstore.admin.cli_common import console, say
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
from kvstore.connector.bench.multiturn_cli import chat_run

if TYPE_CHECKING:
    from kvstore.connector.bench.fleet_report import FleetReport

__all__ = ["FleetOptions", "bench_fleet"]


@bench_options
class FleetOptions:
    out: Path = option(
        default=Path("bench-results/fleet"), help="Folder for fleet.json, fleet.png and the servers' logs"
    )
    conversations: int = option(default=32, help="Concurrent conversations")
    methods: str = option(
        default="fs-rr,ours-rr,ours-aware,obj-rr",
        help="Methods: fs-rr, ours-rr, ours-aware, obj-rr (vLLM's object tier), fs-shared-rr (vLLM's fs tier"
        " on one directory both nodes share: the bound of any shared store here)",
    )
    model: Path | None = option(default=None, help="Model directory (default: the tiny model)")
    context_tokens: int = option(default=2048, help="Opening context of a conversation")
    turn_tokens: int = option(default=256, help="New user tokens per later turn")
    turns: int = option(default=6, help="Turns per conversation")
    output_tokens: int = option(default=8, help="Answer tokens per turn")
    concurrency: int = option(default=4, help="Requests in flight at most, both nodes together")
    engine_kv_mib: int = option(default=32, help="Each engine's KV cache, MiB")
    cpu_mib: int = option(default=64, help="Each node's CPU tier (cpu_bytes_to_use), MiB")
    nvme_gib: float = option(default=8.0, help="Each node's NVMe cache budget (ours), GiB")
    batched_tokens: int = option(default=2048, help="--max-num-batched-tokens")
    chunk_tokens: int = option(default=0, help=CHUNK_TOKENS_HELP)
    pin_nodes: bool = option(
        default=True, help="Give each node's server its own half of the CPUs, as nodes have their own"
    )
    server_core: bool = option(
        default=False,
        help="The local S3 server (and --bucket-rtt-ms's link) on the last core, both nodes on the others for"
        " every method, as if the bucket were served elsewhere",
    )
    tier_options: str = option(default="{}", help=TIER_OPTIONS_HELP)
    bucket_rtt_ms: float = option(default=0.0, help=BUCKET_RTT_MS_HELP)
    bucket_mb_s: float = option(default=0.0, help=BUCKET_MB_S_HELP)

    def at_least_one(self) -> dict[str, int]:
        """The options that count something, each of which must be at least 1."""
        return {
            "--conversations": self.conversations,
            "--context-tokens": self.context_tokens,
            "--turn-tokens": self.turn_tokens,
            "--turns": self.turns,
            "--output-tokens": self.output_tokens,
            "--concurrency": self.concurrency,
            "--engine-kv-mib": self.engine_kv_mib,
            "--cpu-mib": self.cpu_mib,
            "--batched-tokens": self.batched_tokens,
        }


@bench_command("fleet", FleetOptions)
def bench_fleet(o: FleetOptions) -> None:
    """Two vLLM servers standing for two nodes, one bucket, conversations whose turns land on either:
    round-robin with vLLM's fs tier per node, round-robin with ours, cache- and load-aware routing with ours
    (NVIDIA Dynamo's KV indexer), round-robin with vLLM's obj tier; throughput, TTFT, hit shares per tier,
    cross-node hits, CPU seconds, S3 requests."""
    from kvstore.connector.bench.cores import CoresUnavailable
    from kvstore.connector.bench.fleet import METHODS, run_fleet
    from kvstore.connector.bench.fleet_report import write_outputs
    from kvstore.connector.harness.multiturn import Workload
    from kvstore.connector.harness.router import RouterError, unavailable_reason
    from kvstore.connector.harness.vllm_server import VLLMServerError

    methods = [m.strip() for m in o.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        refuse("bad --methods", f"{o.methods!r}; known: {', '.join(METHODS)}")
    if "ours-aware" in methods and (reason := unavailable_reason()) is not None:
        refuse("cannot route by cache", reason)
    for name, value in o.at_least_one().items():
        if value < 1:
            refuse(f"bad {name}", f"{value} (must be at least 1)")
    if not o.nvme_gib > 0 or o.nvme_gib == float("inf"):
        refuse("bad --nvme-gib", f"{o.nvme_gib} (must be a positive number)")
    if o.server_core and not o.pin_nodes:
        refuse("bad --server-core", "the server's core of its own needs the nodes pinned to the others")
    options = tier_options_or_exit(o.tier_options)
    workload = Workload(
        o.conversations, o.context_tokens, o.turn_tokens, o.turns, o.output_tokens, o.concurrency
    )
    try:
        with chat_run(
            "fleet",
            workload,
            # With --server-core a run of methods without a bucket still starts its server, on its core.
            needs_store=o.server_core or any(m.startswith(("ours", "obj")) for m in methods),
            model=o.model,
            engine_kv_mib=o.engine_kv_mib,
            cpu_mib=o.cpu_mib,
            batched_tokens=o.batched_tokens,
            chunk_tokens=chunk_tokens_or_exit(o.chunk_tokens),
            link=link_or_exit(o.bucket_rtt_ms, o.bucket_mb_s),
        ) as run:
            report = run_fleet(
                run.model_dir,
                workload=workload,
                sizing=run.sizing,
                methods=methods,
                store=run.target,
                nvme_bytes=int(o.nvme_gib * 2**30),
                tier_options=options,
                pin_nodes=o.pin_nodes,
                server_core=o.server_core,
                log_dir=o.out / "logs",
                progress=progress,
                on_turn=lambda _turn: run.bar.advance(run.task),
                on_method_start=lambda method, n: run.bar.reset(run.task, total=n, description=method),
            )
    except CoresUnavailable as exc:
        refuse("bad --server-core", exc)
    except ValueError as exc:
        refuse("bad arguments", exc)
    except (VLLMServerError, RouterError) as exc:
        say("benchmark failed", exc)
        raise typer.Exit(1) from None
    title = (
        f"kvstore bench fleet: 2 nodes, {o.conversations} conversations of {o.context_tokens}-token context "
        f"+ {o.turn_tokens} tokens x {o.turns} turns, {o.concurrency} in flight "
        f"({run.model_dir.name}, CPU backend{link_said(report.link)}{_apart_said(report)})"
    )
    _print(report, title)
    json_path, png_path = write_outputs(report, o.out, title)
    console.print(f"results written to {json_path} and {png_path} ({report.elapsed_s:.0f} s)")


def _apart_said(report: FleetReport) -> str:
    if not report.server_cpus:
        return ""
    nodes = sorted({cpu for cpus in report.node_cpus for cpu in cpus})
    return f"; the S3 server on CPU {report.server_cpus[0]}, the nodes on {', '.join(map(str, nodes))}"


def _print(report: FleetReport, title: str) -> None:
    from kvstore.connector.bench.fleet import DESCRIPTIONS

    methods = table(
        title,
        (
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
        ),
    )
    for m in report.methods:
        share = m.token_share
        cpu = {k: m.cpu_s.get(k, 0.0) + m.drain_cpu_s.get(k, 0.0) for k in m.cpu_s}
        engines = sum(v for k, v in cpu.items() if k.endswith("vLLM"))
        agents = sum(v for k, v in cpu.items() if k.endswith("agent"))
        methods.add_row(
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
    console.print(methods)
    economy = table(
        "S3 requests counted at the server (GET includes HEAD), per chunk the tiers loaded and stored",
        ("method", "GET", "GET 404", "PUT", "chunks loaded", "chunks stored", "GET hit/loaded", "PUT/stored",
         "$ per 1M chunks"),
    )  # fmt: skip
    for m in report.methods:
        if not m.s3_requests:
            continue
        per = m.request_economy()
        economy.add_row(
            m.method,
            *(f"{m.s3_requests.get(k, 0.0):,.0f}" for k in ("get", "get_missing", "put")),
            f"{m.chunks_loaded:,.0f}",
            f"{m.chunks_stored:,.0f}",
            f"{per['get_per_chunk_loaded']:.2f}",
            f"{per['put_per_chunk_stored']:.2f}",
            f"{per['usd_per_million_chunks']:.2f}",
        )
    if economy.row_count:
        console.print(economy)
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
    goals = {
        "ours-rr/fs-rr": " (goal: >= 1.3x)",
        "ours-aware/ours-rr": " (goal: > 1x)",
        "ours-rr/obj-rr": " (goal: > 1x)",
    }
    for name, ratio in report.ratios().items():
        if ratio is not None:
            console.print(f"{name}: {ratio:.2f}x{goals.get(name, '')}")
