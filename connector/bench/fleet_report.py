"""`bench fleet`'s figures: per method and per node, worked out from the turns and each server's `/metrics`
before and after (where the prompt tokens came from, how the turns were routed); the report, its JSON and
its plot."""

from __future__ import annotations

import itertools
import json
import math
import statistics
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstore.connector.bench.multiturn import Sizing
from kvstore.connector.bench.outputs import figure, json_and_png
from kvstore.connector.harness.routed import RoutedTurn
from kvstore.connector.harness.s3_requests import RequestCounts
from kvstore.connector.harness.vllm_server import metric_total

__all__ = [
    "SHARES",
    "FleetReport",
    "MethodResult",
    "NodeResult",
    "load_report",
    "method_result",
    "plot_report",
    "tier_chunks",
    "write_outputs",
]

SHARES = ("engine", "cpu", "node_disk", "bucket", "computed")


@dataclass
class NodeResult:
    node: int
    requests: int
    prompt_tokens: int
    served: dict[str, float]  # prompt tokens from device, host, disk (this server's /metrics)
    chunk_hits: dict[str, float] = field(default_factory=dict)  # ours: nvme, object (vllm:kvstore_chunk_hits)
    read_bytes: dict[str, float] = field(default_factory=dict)  # ours: nvme, object (vllm:kvstore_read_bytes)
    read_s: dict[str, float] = field(default_factory=dict)  # ours: time its loads took, per tier
    uploaded_chunks: int = 0  # ours: chunks this node's agent uploaded (its change log)
    cross_node_chunks: int = 0  # ours: chunks it fetched from the bucket that only the other node uploaded


@dataclass
class MethodResult:
    method: str
    requests: int
    prompt_tokens: int
    wall_s: float
    prompt_tokens_per_s: float
    requests_per_s: float
    ttft_mean_s: float
    ttft_p90_s: float
    ttft_by_turn_s: list[float]  # mean TTFT of each turn index (0: the opening context, computed everywhere)
    last_turn_tokens: int  # prompt tokens of a conversation's last turn: its KV footprint between turns
    # Share of all prompt tokens: engine prefix cache, CPU tier, the node's own storage (fs directory, the
    # shared one for fs-shared-rr, or our NVMe), the bucket, computed.
    token_share: dict[str, float]
    nodes: list[NodeResult]
    cross_node_chunks: int = 0
    duplicate_uploads: int = 0  # chunks both nodes computed and uploaded
    backlog_at_end: int = 0  # chunks waiting for upload when the last turn finished
    drain_s: float | None = None  # until both upload journals were empty (None: not within the timeout)
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds per process during the turns
    # Prompt tokens per CPU second of all of them: throughput per share of the machine the run got (vLLM's
    # CPU engine spins while it waits, so it uses what it is given; on a shared machine, this moves less).
    prompt_tokens_per_cpu_s: float = 0.0
    drain_cpu_s: dict[str, float] = field(default_factory=dict)  # ... and during the drain
    routing: dict[str, float] = field(default_factory=dict)
    # Methods on S3: the requests the S3 server counted during the turns, and the chunks the storage tiers
    # loaded and stored by vLLM's own counters (both nodes).
    s3_requests: dict[str, float] = field(default_factory=dict)
    chunks_loaded: float = 0.0
    chunks_stored: float = 0.0

    def request_economy(self) -> dict[str, float]:
        """Found GETs per chunk loaded, PUTs per chunk stored, US dollars per million chunks moved."""
        if not self.s3_requests:
            return {}
        counts = RequestCounts(**self.s3_requests)
        moved = self.chunks_loaded + self.chunks_stored
        return {
            "get_per_chunk_loaded": (counts.get - counts.get_missing) / self.chunks_loaded
            if self.chunks_loaded
            else 0.0,
            "put_per_chunk_stored": counts.put / self.chunks_stored if self.chunks_stored else 0.0,
            "usd_per_million_chunks": counts.usd_per_million(moved),
        }


@dataclass
class FleetReport:
    workload: dict[str, Any]
    sizing: dict[str, Any]
    nvme_bytes: int
    tier_options: dict[str, Any]  # added to our tier's entry
    node_cpus: list[list[int]]  # the CPUs each node's server (and its node agent) ran on; [] = any
    conversation_tokens: int  # prompt tokens of a conversation's last turn (its KV footprint)
    engine_conversations: float  # how many conversations' KV one node's engine cache holds
    cpu_conversations: float  # ... and one node's CPU tier
    methods: list[MethodResult] = field(default_factory=list)
    elapsed_s: float = 0.0
    link: str = ""  # the S3 server was reached through a link of this shape (`StoreTarget.link`)
    server_cpus: list[int] = field(default_factory=list)  # the S3 server's own cores (`--server-core`)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ratios": self.ratios()}, indent=2)

    def ratios(self) -> dict[str, float | None]:
        """Throughput ratios the goals name: ours round-robin vs fs round-robin (>= 1.3x), cache-aware vs
        round-robin with ours (> 1x), cache-aware vs fs round-robin, ours vs vLLM's obj tier round-robin;
        and the bound: a shared directory vs fs round-robin, ours vs that shared directory."""
        tput = {m.method: m.prompt_tokens_per_s for m in self.methods}

        def ratio(a: str, b: str) -> float | None:
            return tput[a] / tput[b] if a in tput and b in tput and tput[b] > 0 else None

        return {
            "ours-rr/fs-rr": ratio("ours-rr", "fs-rr"),
            "ours-aware/ours-rr": ratio("ours-aware", "ours-rr"),
            "ours-aware/fs-rr": ratio("ours-aware", "fs-rr"),
            "ours-rr/obj-rr": ratio("ours-rr", "obj-rr"),
            "fs-shared-rr/fs-rr": ratio("fs-shared-rr", "fs-rr"),
            "ours-rr/fs-shared-rr": ratio("ours-rr", "fs-shared-rr"),
        }


def method_result(
    method: str,
    turns: list[RoutedTurn],
    before: list[dict[str, float]],
    after: list[dict[str, float]],
    *,
    ours: bool,
    bucket_only: bool = False,
) -> MethodResult:
    """A method's figures from its turns (each with the server it went to) and each server's `/metrics`
    before and after them. `bucket_only`: the storage tier has nothing on the node (vLLM's obj tier)."""
    nodes: list[NodeResult] = []
    for node, (b, a) in enumerate(zip(before, after, strict=True)):

        def delta(name: str, b: dict[str, float] = b, a: dict[str, float] = a, **labels: str) -> float:
            return float(metric_total(a, name, **labels) - metric_total(b, name, **labels))

        mine = [t for t in turns if t.server == node]
        nodes.append(
            NodeResult(
                node=node,
                requests=len(mine),
                prompt_tokens=sum(t.record.prompt_tokens for t in mine),
                served={
                    **{
                        src: delta("vllm:prompt_tokens_cached_by_source_total", source=src)
                        for src in ("device", "host", "disk")
                    },
                    "total": delta("vllm:prompt_tokens_total"),
                },
                chunk_hits=(
                    {tier: delta("vllm:kvstore_chunk_hits_total", tier=tier) for tier in ("nvme", "object")}
                    if ours
                    else {}
                ),
                read_bytes=(
                    {tier: delta("vllm:kvstore_read_bytes_total", tier=tier) for tier in ("nvme", "object")}
                    if ours
                    else {}
                ),
                read_s=(
                    {tier: delta("vllm:kvstore_read_seconds_total", tier=tier) for tier in ("nvme", "object")}
                    if ours
                    else {}
                ),
            )
        )
    records = [t.record for t in turns]
    prompt_tokens = sum(r.prompt_tokens for r in records)
    wall = max(r.finished_s for r in records)
    ttfts = sorted(r.ttft_s for r in records)
    return MethodResult(
        method=method,
        requests=len(records),
        prompt_tokens=prompt_tokens,
        wall_s=wall,
        prompt_tokens_per_s=prompt_tokens / wall,
        requests_per_s=len(records) / wall,
        ttft_mean_s=statistics.fmean(ttfts),
        ttft_p90_s=ttfts[min(len(ttfts) - 1, math.ceil(0.9 * len(ttfts)) - 1)],
        ttft_by_turn_s=[
            statistics.fmean(r.ttft_s for r in records if r.turn == turn)
            for turn in sorted({r.turn for r in records})
        ],
        last_turn_tokens=max(r.prompt_tokens for r in records),
        token_share=_shares(nodes, ours=ours, bucket_only=bucket_only),
        nodes=nodes,
        routing=_routing(turns, len(before)),
    )


def tier_chunks(
    before: list[dict[str, float]], after: list[dict[str, float]], sizing: Sizing
) -> tuple[float, float]:
    """Chunks the nodes' storage tiers loaded and stored during the turns, by vLLM's own counters."""
    loaded = stored = 0.0
    for b, a in zip(before, after, strict=True):
        for name, bucket in (("read", "loaded"), ("write", "stored")):
            metric = f"vllm:kv_offload_tiering_{name}_bytes_total"
            chunks = (metric_total(a, metric) - metric_total(b, metric)) / sizing.chunk_bytes
            if bucket == "loaded":
                loaded += chunks
            else:
                stored += chunks
    return loaded, stored


def _shares(nodes: list[NodeResult], *, ours: bool, bucket_only: bool) -> dict[str, float]:
    """Where the fleet's prompt tokens came from. Our tier's storage tokens are split between NVMe and the
    bucket in the ratio of the bytes it loaded from each: its chunk hits are counted where the lookup
    found a chunk, and a chunk found in the bucket may be on NVMe by the time it loads (the node agent
    admitted it meanwhile), which the load prefers."""
    total = max(1.0, sum(n.served["total"] for n in nodes))
    engine = sum(n.served["device"] for n in nodes)
    cpu = sum(n.served["host"] for n in nodes)
    disk = sum(n.served["disk"] for n in nodes)
    weights = {tier: sum(n.read_bytes.get(tier, 0.0) for n in nodes) for tier in ("nvme", "object")}
    if not any(weights.values()):
        weights = {tier: sum(n.chunk_hits.get(tier, 0.0) for n in nodes) for tier in ("nvme", "object")}
    loaded = weights["nvme"] + weights["object"]
    bucket = disk * weights["object"] / loaded if ours and loaded > 0 else 0.0
    if bucket_only:
        bucket = disk
    share = {
        "engine": engine / total,
        "cpu": cpu / total,
        "node_disk": (disk - bucket) / total,
        "bucket": bucket / total,
    }
    share["computed"] = max(0.0, 1.0 - sum(share.values()))
    return share


def _routing(turns: list[RoutedTurn], servers: int) -> dict[str, float]:
    """How the turns were spread: per server, how often a turn went where its conversation's previous turn
    went, ties, routing time, and (cache-aware) turns whose routed token count differs from the server's."""
    by_conversation: dict[int, list[RoutedTurn]] = {}
    for t in turns:
        by_conversation.setdefault(t.record.conversation, []).append(t)
    follow = same = 0
    for conv in by_conversation.values():
        conv.sort(key=lambda t: t.record.turn)
        for previous, current in itertools.pairwise(conv):
            follow += 1
            same += previous.server == current.server
    out: dict[str, float] = {f"requests_node{n}": sum(t.server == n for t in turns) for n in range(servers)}
    out["same_node_share"] = same / follow if follow else 0.0
    out["route_ms_mean"] = 1000 * statistics.fmean(t.route_s for t in turns) if turns else 0.0
    scored = [t for t in turns if t.route.prompt_tokens is not None]
    if scored:
        out["tie_share"] = sum(t.route.tied for t in scored) / len(scored)
        out["tokenize_ms_mean"] = 1000 * statistics.fmean(t.route.tokenize_s for t in scored)
        out["query_ms_mean"] = 1000 * statistics.fmean(t.route.query_s for t in scored)
        out["token_mismatches"] = sum(t.route.prompt_tokens != t.record.prompt_tokens for t in scored)
    return out


# -- outputs ---------------------------------------------------------------------------------------------


def load_report(path: Path) -> FleetReport:
    """A report back from its JSON file (to re-plot it)."""
    raw = json.loads(path.read_text())
    raw.pop("ratios", None)
    methods = []
    for m in raw.pop("methods"):
        nodes = [NodeResult(**n) for n in m.pop("nodes")]
        methods.append(MethodResult(**m, nodes=nodes))
    return FleetReport(**raw, methods=methods)


def write_outputs(report: FleetReport, out_dir: Path, title: str) -> tuple[Path, Path]:
    """`fleet.json` and `fleet.png` under `out_dir`."""
    return json_and_png(out_dir, "fleet", report.to_json(), lambda png: plot_report(report, png, title))


_SHARE_LABELS = {
    "engine": "engine KV cache",
    "cpu": "CPU tier",
    "node_disk": "node disk (fs dir / our NVMe)",
    "bucket": "bucket (S3)",
    "computed": "computed",
}


def plot_report(report: FleetReport, path: Path, title: str) -> None:
    """Four panels, one bar per method: prompt tokens/s, TTFT (mean and p90), where the prompt tokens came
    from, CPU seconds per process."""
    methods = report.methods
    names = [m.method for m in methods]
    xs = list(range(len(methods)))
    with figure(path, 2, 2, figsize=(11, 9)) as (fig, axes):
        (tput, ttft), (shares, cpu) = axes
        bars = tput.bar(xs, [m.prompt_tokens_per_s for m in methods], color="tab:blue")
        tput.bar_label(bars, fmt="{:,.0f}", fontsize=8)
        tput.set_ylabel("prompt tokens/s (cache hits included)")
        width = 0.38
        ttft.bar([x - width / 2 for x in xs], [m.ttft_mean_s for m in methods], width, label="mean")
        ttft.bar([x + width / 2 for x in xs], [m.ttft_p90_s for m in methods], width, label="p90")
        ttft.set_ylabel("TTFT (s), routing included")
        ttft.legend(fontsize=8)
        bottom = [0.0] * len(methods)
        for key in SHARES:
            values = [100 * m.token_share.get(key, 0.0) for m in methods]
            shares.bar(xs, values, bottom=bottom, label=_SHARE_LABELS[key])
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        shares.set_ylabel("% of prompt tokens")
        shares.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
        labels = sorted({k for m in methods for k in m.cpu_s})
        bottom = [0.0] * len(methods)
        for label in labels:
            values = [m.cpu_s.get(label, 0.0) + m.drain_cpu_s.get(label, 0.0) for m in methods]
            cpu.bar(xs, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        cpu.set_ylabel("CPU seconds (turns + upload drain)")
        cpu.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=4)
        for ax in (tput, ttft, shares, cpu):
            ax.set_xticks(xs, names)
            ax.grid(True, axis="y", alpha=0.3)
        fig.suptitle(textwrap.fill(title, 110), fontsize=10)
