"""What `kvstore demo` shows: a progress bar over the replay, then where the KV came from and the TTFT
saved, on the first node and on a new node served from the bucket. The work itself is
`kvstore.connector.demo.run.run_demo`.

Readable at any width, on a terminal or in a file: URLs and commands are printed as soft-wrapped lines
(never broken inside a URL; the terminal wraps them whole), and table cells fold onto more lines instead of
being cut to a few characters and "…".
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from rich.console import Console, JustifyMethod
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstore.config import Settings


def show_demo(settings: Settings, console: Console, *, conversations: int, turns: int, hold: bool) -> None:
    from kvstore.connector.demo.run import DemoOptions, DemoReport, run_demo
    from kvstore.connector.harness.multiturn import TurnRecord

    options = DemoOptions(conversations=conversations, turns=turns)
    progress = Progress(
        TextColumn("multi-turn replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("turns  last TTFT {task.fields[ttft]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    task = progress.add_task("replay", total=conversations * turns, ttft="-")

    def on_turn(record: TurnRecord) -> None:
        if not progress.live.is_started:
            progress.start()
        progress.update(task, advance=1, ttft=f"{record.ttft_s:.3f} s")
        if progress.finished:
            progress.stop()

    def finish(report: DemoReport) -> None:
        _print_report(console, report)
        if hold:
            console.print("\n[bold]Everything is still running[/bold]; press Ctrl-C to stop it all.")
            _wait_for_interrupt()

    try:
        run_demo(settings, options, say=lambda msg: _line(console, f"[dim]... {msg}[/dim]"), on_turn=on_turn,
                 hold=finish)  # fmt: skip
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopped everything the demo started[/yellow]")
    finally:
        progress.stop()
    console.print("[dim]stopped vLLM, the admin service and the S3 server[/dim]")


def _wait_for_interrupt() -> None:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _line(console: Console, markup: str) -> None:
    """One logical line that rich must not break (it carries URLs): the terminal soft-wraps it whole."""
    console.print(markup, soft_wrap=True)


def _table(title: str, *columns: tuple[str, JustifyMethod]) -> Table:
    """A table whose cells fold onto more lines when the console is narrow, never truncated."""
    table = Table(title=title)
    for name, justify in columns:
        table.add_column(name, justify=justify, overflow="fold")
    return table


def _rate(hits: float, queries: float) -> str:
    return f"{hits / queries:.0%} ({hits:,.0f} of {queries:,.0f})" if queries else "-"


def _print_report(console: Console, report: object) -> None:
    from kvstore.connector.demo.run import DemoReport

    assert isinstance(report, DemoReport)
    turns = _table(
        "TTFT by turn (every turn resends the whole conversation)",
        *((col, "right") for col in ("turn", "requests", "mean TTFT s", "prompt tokens from a cache")),
    )
    for turn, ttft in report.ttft_by_turn.items():
        records = [r for r in report.turns if r.turn == turn]
        prompt = sum(r.prompt_tokens for r in records)
        cached = sum(r.cached_tokens or 0 for r in records)
        turns.add_row(
            str(turn + 1), str(len(records)), f"{ttft:.3f}", f"{cached / prompt:.0%}" if prompt else "-"
        )
    console.print(turns)

    sources = _table(
        "Where the prompt tokens came from", *((col, "right") for col in ("source", "tokens", "share"))
    )
    labels = {"device": "engine KV cache (prefix cache)", "host": "CPU tier", "disk": "KVStoreTier"}
    total = report.prompt_tokens or 1.0
    for source, label in labels.items():
        tokens = report.token_sources.get(source, 0.0)
        sources.add_row(label, f"{tokens:,.0f}", f"{tokens / total:.0%}")
    computed = max(0.0, report.prompt_tokens - sum(report.token_sources.values()))
    sources.add_row("recomputed", f"{computed:,.0f}", f"{computed / total:.0%}")
    console.print(sources)

    tiers = _table(
        "KVStoreTier chunk lookups (hit rate per tier)",
        ("tier", "left"),
        ("first node", "right"),
        ("new node, empty NVMe", "right"),
    )
    for tier, counts in report.kvstore_tiers.items():
        fresh = report.new_node_tiers.get(tier)
        tiers.add_row({"nvme": "NVMe cache", "object": "object store"}.get(tier, tier),
                      _rate(counts.hits, counts.queries),
                      _rate(fresh.hits, fresh.queries) if fresh is not None else "-")  # fmt: skip
    console.print(tiers)

    saved = report.returning_recompute_s - report.returning_hit_s
    if report.returning_hit_s > 0:
        console.print(
            f"\nReturning user ({report.returning_hit_tokens:,} prompt tokens served from a cache): TTFT "
            f"[bold]{report.returning_hit_s:.3f} s[/bold] from the cache vs [bold]"
            f"{report.returning_recompute_s:.3f} s[/bold] recomputed on the same engine "
            f"({saved:+.3f} s saved, {report.returning_recompute_s / report.returning_hit_s:.1f}x faster)."
        )
    if report.new_node_hit_s > 0:
        fresh = report.new_node_tiers.get("object")
        from_bucket = f"{fresh.hits:,.0f} chunks from the object store" if fresh is not None else "the bucket"
        users = len(report.new_node_hits_s)
        each = ", ".join(
            f"{hit:.3f} vs {recomputed:.3f} s"
            for hit, recomputed in zip(report.new_node_hits_s, report.new_node_recomputes_s, strict=False)
        )
        hit_s, recompute_s = report.new_node_hit_s, report.new_node_recompute_s
        console.print(
            f"A new node with an empty NVMe cache ({users} returning users, {report.new_node_hit_tokens:,} "
            f"prompt tokens each from a cache, {from_bucket}): median TTFT [bold]{hit_s:.3f} s[/bold] from "
            f"the bucket vs [bold]{recompute_s:.3f} s[/bold] recomputed on that engine "
            f"({recompute_s / hit_s:.1f}x faster; each user: {each})."
        )
    if report.new_node_phases:
        phases = _table(
            "Where the new node's median request went (the tier's timeline; CPU of the vLLM server)",
            ("phase", "left"),
            ("from ms", "right"),
            ("took ms", "right"),
            ("CPU ms", "right"),
        )
        for phase in report.new_node_phases:
            phases.add_row(
                phase.name,
                f"{phase.start_ms:.1f}",
                f"{phase.end_ms - phase.start_ms:.1f}",
                f"{phase.cpu_ms:.1f}",
            )
        console.print(phases)
    console.print("\nLook around:")
    links = [
        ("vLLM metrics (vllm:kvstore_*)", f"{report.vllm_url}/metrics"),
        ("the new node's metrics", f"{report.new_node_url}/metrics" if report.new_node_url else ""),
        ("admin API docs", f"{report.admin_url}/docs"),
        ("kvstore metrics and stats", f"{report.admin_url}/metrics   {report.admin_url}/v1/stats"),
        (
            "Grafana dashboard (Docker)",
            "docker compose -f compose/docker-compose.yml up, then http://127.0.0.1:3000",
        ),
    ]
    for label, where in links:
        if where:
            _line(console, f"  {label + ':':<31} {where}")
