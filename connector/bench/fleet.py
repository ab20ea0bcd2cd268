"""`kvstore bench fleet`: two vLLM servers standing for two nodes, conversations whose turns land on either.

The workload of `kvstore bench multiturn` (every conversation active at once, each turn resending the whole
history), sent to two real vLLM OpenAI servers, each with its own engine KV cache, CPU tier and local
directory (nodes share no disk). Methods, each on fresh servers and directories:

- `fs-rr`: round-robin, vLLM's `fs` tier on each node (two separate directories);
- `ours-rr`: round-robin, KVStoreTier on each node (its own NVMe cache and node agent), one shared bucket;
- `ours-aware`: KVStoreTier as above, each turn sent to the server NVIDIA Dynamo's KV indexer credits most
  (engines publish KV events, the tier's included; tiers weighted as Dynamo's router weighs them, see
  `harness.routed`).

Round-robin sends a conversation's turns to the two nodes in turn: with `fs`, a node can reuse only what it
computed itself two turns earlier; with ours, the other node's last turn is in the bucket once its node agent
uploaded it. Cache-aware routing keeps a conversation where its KV is.

Per method: prompt tokens/s (cache hits included) and requests/s over the wall time, TTFT mean and p90 as the
client sees it (routing included), where the prompt tokens came from (`vllm:prompt_tokens_cached_by_source`:
engine, CPU tier, storage; the storage part split between our NVMe and the bucket by our tier's chunk hits),
cross-node chunks (chunks a node fetched from the bucket that the other node uploaded, from each node's
change log and NVMe cache), CPU seconds per process (each server's process group, each node agent, the S3
server, the indexer, this client) and, for ours, how long the upload journals took to drain after the last
turn. Sizing as in multiturn: each node's engine KV cache and CPU tier too small for the conversations, so
turns must come from storage; the NVMe cache large enough never to evict (as a node's disk would be).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import shutil
import statistics
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstore.agent.supervisor import LOG_NAME, agent_status, stop_agent
from kvstore.agent.uploads import wait_uploaded
from kvstore.cache import ChangeKind, NVMeCache
from kvstore.connector.bench.multiturn import Sizing, conversation_tokens
from kvstore.connector.bench.target import StoreTarget
from kvstore.connector.harness.multiturn import Workload, replay
from kvstore.connector.harness.routed import (
    CacheAware,
    RoundRobin,
    RoutedTurn,
    Router,
    local_chat_tokenizer,
    replay_routed,
)
from kvstore.connector.harness.router import DynamoIndexer, dynamo_indexer, free_port
from kvstore.connector.harness.servers import ServerSpec, vllm_servers
from kvstore.connector.harness.vllm_server import VLLMServer, metric_total

__all__ = [
    "METHODS",
    "FleetReport",
    "MethodResult",
    "NodeResult",
    "load_report",
    "plot_report",
    "run_fleet",
    "write_outputs",
]

METHODS = ("fs-rr", "ours-rr", "ours-aware")
DESCRIPTIONS = {
    "fs-rr": "round-robin, vLLM fs tier per node",
    "ours-rr": "round-robin, ours (shared bucket)",
    "ours-aware": "cache-aware (Dynamo indexer), ours",
}
NODES = 2
BLOCK_TOKENS = 128  # vLLM's block size on the CPU backend, which the indexer must be told
SHARES = ("engine", "cpu", "node_disk", "bucket", "computed")
_OURS = ("ours-rr", "ours-aware")
_SETTLE_S = 2.0  # admissions are done once the NVMe caches stopped growing this long


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
    # Share of all prompt tokens: engine prefix cache, CPU tier, the node's own storage (fs directory or our
    # NVMe), the bucket, computed.
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

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ratios": self.ratios()}, indent=2)

    def ratios(self) -> dict[str, float | None]:
        """Throughput ratios the goals name: ours round-robin vs fs round-robin (>= 1.5x), cache-aware vs
        round-robin with ours (> 1x), cache-aware vs fs round-robin."""
        tput = {m.method: m.prompt_tokens_per_s for m in self.methods}

        def ratio(a: str, b: str) -> float | None:
            return tput[a] / tput[b] if a in tput and b in tput and tput[b] > 0 else None

        return {
            "ours-rr/fs-rr": ratio("ours-rr", "fs-rr"),
            "ours-aware/ours-rr": ratio("ours-aware", "ours-rr"),
            "ours-aware/fs-rr": ratio("ours-aware", "fs-rr"),
        }


def run_fleet(
    model_dir: Path,
    *,
    workload: Workload,
    sizing: Sizing,
    methods: Sequence[str] = METHODS,
    store: StoreTarget | None = None,
    nvme_bytes: int = 8 << 30,
    tier_options: dict[str, Any] | None = None,
    pin_nodes: bool = True,
    workdir: Path | None = None,
    log_dir: Path | None = None,
    drain_timeout_s: float = 600.0,
    progress: Callable[[str], None] = print,
    on_turn: Callable[[RoutedTurn], None] | None = None,
    on_method_start: Callable[[str, int], None] | None = None,
) -> FleetReport:
    """Every method of `methods` in turn, on fresh servers; `on_method_start(method, requests)` runs before
    each measured replay. Server, indexer and agent logs go to `log_dir` when given; `tier_options` are
    added to our tier's `secondary_tiers` entry on both nodes (e.g. `gil_switch_interval_s`).

    `pin_nodes`: each node's server gets its own share of this process's CPUs, as nodes have their own
    (`node_cpus`); its node agent, which it starts, inherits them. Unpinned, the two engines' OpenMP teams
    bind to the same cores (vLLM binds every engine to all of them) and spin against each other."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    if store is None and any(m in _OURS for m in methods):
        raise ValueError("methods with our tier need a store target")
    footprint = conversation_tokens(workload)
    report = FleetReport(
        workload=asdict(workload),
        sizing=asdict(sizing),
        nvme_bytes=nvme_bytes,
        tier_options=dict(tier_options or {}),
        node_cpus=_node_cpus() if pin_nodes else [[] for _ in range(NODES)],
        conversation_tokens=footprint,
        engine_conversations=sizing.engine_kv_bytes / sizing.kv_bytes_per_token / footprint,
        cpu_conversations=sizing.cpu_bytes / sizing.kv_bytes_per_token / footprint,
    )
    began = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-fleet-", dir=workdir))
    try:
        for method in methods:
            run = _MethodRun(method, model_dir, workload, sizing, store, report, root / method, log_dir)
            progress(f"{method} ({DESCRIPTIONS[method]}): starting {NODES} vLLM servers")
            result = run.run(drain_timeout_s, progress, on_turn, on_method_start)
            report.methods.append(result)
            progress(
                f"{method}: {result.prompt_tokens_per_s:,.0f} prompt tokens/s, "
                f"TTFT {result.ttft_mean_s:.3f} s mean"
            )
        if report.methods:  # the measured footprint replaces the estimate
            measured = max(m.last_turn_tokens for m in report.methods)
            report.conversation_tokens = measured
            report.engine_conversations = sizing.engine_kv_bytes / sizing.kv_bytes_per_token / measured
            report.cpu_conversations = sizing.cpu_bytes / sizing.kv_bytes_per_token / measured
        report.elapsed_s = time.perf_counter() - began
        return report
    finally:
        shutil.rmtree(root, ignore_errors=True)


class _MethodRun:
    """One method: its directories, servers, indexer and agents, its replay, its figures."""

    def __init__(
        self,
        method: str,
        model_dir: Path,
        workload: Workload,
        sizing: Sizing,
        store: StoreTarget | None,
        report: FleetReport,
        root: Path,
        log_dir: Path | None,
    ) -> None:
        self.method = method
        self.model_dir = model_dir
        self.workload = workload
        self.sizing = sizing
        self.store = store
        self.nvme_bytes = report.nvme_bytes
        self.tier_options = report.tier_options
        self.root = root
        self.log_dir = log_dir
        self.ours = method in _OURS
        self.aware = method == "ours-aware"
        self.cache_dirs = [root / f"node{i}" / "nvme" for i in range(NODES)]
        self.node_cpus = report.node_cpus
        self.store_url = (
            f"{store.store_url.rstrip('/')}/fleet-{method}-{time.time_ns()}" if store is not None else ""
        )

    def run(
        self,
        drain_timeout_s: float,
        progress: Callable[[str], None],
        on_turn: Callable[[RoutedTurn], None] | None,
        on_method_start: Callable[[str, int], None] | None,
    ) -> MethodResult:
        logs = self.log_dir or self.root
        logs.mkdir(parents=True, exist_ok=True)
        ports = [(free_port(), free_port()) for _ in range(NODES)]
        began = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if self.ours:
                # Registered first, so it runs last: after the servers stopped, which would start new agents.
                stack.callback(self._stop_agents, logs)
            indexer: DynamoIndexer | None = None
            if self.aware:
                indexer = stack.enter_context(dynamo_indexer(log_path=logs / f"{self.method}-indexer.log"))
            specs = [self._spec(node, ports[node], logs) for node in range(NODES)]
            servers = stack.enter_context(vllm_servers(specs))
            progress(f"{self.method}: servers up in {time.perf_counter() - began:.0f} s")
            router: Router = RoundRobin(NODES)
            if indexer is not None:
                for node, (port, replay_port) in enumerate(ports):
                    indexer.register(
                        node + 1,
                        f"tcp://127.0.0.1:{port}",
                        model=servers[node].model,
                        block_size=BLOCK_TOKENS,
                        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                    )
                router = CacheAware(
                    indexer,
                    [n + 1 for n in range(NODES)],
                    model=servers[0].model,
                    block_size=BLOCK_TOKENS,
                    tokenize=local_chat_tokenizer(self.model_dir),
                )
            for node, server in enumerate(servers):  # one-off costs of the first requests: not measured
                asyncio.run(replay(server.base_url, server.model, _warmup(self.workload, node)))
            if on_method_start is not None:
                on_method_start(self.method, self.workload.conversations * self.workload.turns)
            result = self._measure(servers, indexer, router, drain_timeout_s, progress, on_turn)
            stopping = time.perf_counter()
        progress(f"{self.method}: everything it started stopped in {time.perf_counter() - stopping:.0f} s")
        return result

    def _spec(self, node: int, ports: tuple[int, int], logs: Path) -> ServerSpec:
        node_dir = self.root / f"node{node}"
        env: dict[str, str] = {}
        cpus = self.node_cpus[node]
        extra = self.sizing.server_args()
        if self.ours:
            assert self.store is not None
            tier: dict[str, Any] = {
                "type": "KVStoreTier",
                "module_path": "kvstore.connector.tier",
                "store_url": self.store_url,
                "cache_dir": str(self.cache_dirs[node]),
                "cache_bytes": self.nvme_bytes,
                **self.tier_options,
            }
            if self.store.endpoint:
                tier["s3_endpoint"] = self.store.endpoint
            env.update(self.store.env)
            if self.aware:
                tier["enable_kv_events"] = True
        else:
            tier = {"type": "fs", "root_dir": str(node_dir / "fs")}
        config = self.sizing.tiering_config(tier)
        if self.aware:
            config["kv_connector_extra_config"]["self_describing_kv_events"] = True
            port, replay_port = ports
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{port}",  # the indexer connects to the engine
                "replay_endpoint": f"tcp://*:{replay_port}",
            }
            extra = [*extra, "--kv-events-config", json.dumps(events)]
        if cpus:  # vLLM binds its OpenMP threads itself, to every core unless told
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
        return ServerSpec(
            self.model_dir,
            kv_transfer_config=config,
            env=env,
            extra_args=extra,
            log_path=logs / f"{self.method}-node{node}.log",
            cpus=frozenset(cpus) if cpus else None,
        )

    def _measure(
        self,
        servers: list[VLLMServer],
        indexer: DynamoIndexer | None,
        router: Router,
        drain_timeout_s: float,
        progress: Callable[[str], None],
        on_turn: Callable[[RoutedTurn], None] | None,
    ) -> MethodResult:
        workload = Workload(**{**asdict(self.workload), "seed": 1})
        accounts = self._accounts(servers, indexer)
        before = [s.metrics() for s in servers]
        cpu_before = accounts.cpu_s()
        urls = [s.base_url for s in servers]
        turns = asyncio.run(replay_routed(urls, servers[0].model, workload, router, on_turn))
        cpu_after = accounts.cpu_s()
        time.sleep(1.5)  # the engines publish their counters at the end of a step; let the last ones land
        after = [s.metrics() for s in servers]
        result = _result(self.method, turns, before, after, ours=self.ours)
        result.cpu_s = _delta(cpu_before, cpu_after)
        result.prompt_tokens_per_cpu_s = result.prompt_tokens / max(0.01, sum(result.cpu_s.values()))
        if self.ours:
            self._drain(result, drain_timeout_s, progress)
            result.drain_cpu_s = _delta(cpu_after, accounts.cpu_s())
        return result

    def _accounts(self, servers: list[VLLMServer], indexer: DynamoIndexer | None) -> _Accounts:
        groups = {f"node{i} vLLM": s.process.pid for i, s in enumerate(servers)}
        pids: dict[str, int] = {}
        if indexer is not None:
            groups["indexer"] = indexer.process.pid
        if self.ours:
            for node, directory in enumerate(self.cache_dirs):
                pid = agent_status(directory).pid
                if pid is not None:
                    pids[f"node{node} agent"] = pid
            if self.store is not None and self.store.server_pid is not None:
                pids["S3 server"] = self.store.server_pid
        return _Accounts(groups, pids)

    def _drain(self, result: MethodResult, timeout_s: float, progress: Callable[[str], None]) -> None:
        """The journals' drain after the last turn, then what crossed nodes through the bucket."""
        with contextlib.ExitStack() as stack:
            caches = [stack.enter_context(NVMeCache(d, self.nvme_bytes)) for d in self.cache_dirs]
            result.backlog_at_end = sum(c.backlog().chunks for c in caches)
            progress(f"{self.method}: {result.backlog_at_end} chunks wait for upload; draining")
            start = time.perf_counter()
            deadline = start + timeout_s
            drained = all(wait_uploaded(c, max(0.0, deadline - time.perf_counter())) for c in caches)
            result.drain_s = time.perf_counter() - start if drained else None
            _settle(caches, deadline)
            uploaded = [_uploaded_keys(c) for c in caches]
            for node, cache in enumerate(caches):
                theirs = sorted(
                    set().union(*(u for i, u in enumerate(uploaded) if i != node)) - uploaded[node]
                )
                fetched = sum(cache.contains_many(theirs)) if theirs else 0
                result.nodes[node].uploaded_chunks = len(uploaded[node])
                result.nodes[node].cross_node_chunks = fetched
            result.cross_node_chunks = sum(n.cross_node_chunks for n in result.nodes)
            result.duplicate_uploads = len(set.intersection(*uploaded)) if uploaded else 0

    def _stop_agents(self, logs: Path) -> None:
        for node, directory in enumerate(self.cache_dirs):
            stop_agent(directory, timeout_s=10)
            log = directory / LOG_NAME
            if self.log_dir is not None and log.exists():
                with contextlib.suppress(OSError):
                    shutil.copyfile(log, logs / f"{self.method}-node{node}-agent.log")


def _node_cpus() -> list[list[int]]:
    """This process's CPUs split evenly between the nodes ([] each when there are fewer CPUs than nodes)."""
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // NODES
    if share == 0:
        return [[] for _ in range(NODES)]
    return [cpus[i * share : (i + 1) * share] for i in range(NODES)]


def _warmup(workload: Workload, node: int) -> Workload:
    """Two short conversations per server, with seeds no measured replay uses."""
    return Workload(
        conversations=2,
        context_tokens=min(256, workload.context_tokens),
        turn_tokens=min(64, workload.turn_tokens),
        turns=2,
        output_tokens=workload.output_tokens,
        concurrency=2,
        seed=1000 + node,
    )


def _result(
    method: str,
    turns: list[RoutedTurn],
    before: list[dict[str, float]],
    after: list[dict[str, float]],
    *,
    ours: bool,
) -> MethodResult:
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
        token_share=_shares(nodes, ours=ours),
        nodes=nodes,
        routing=_routing(turns),
    )


def _shares(nodes: list[NodeResult], *, ours: bool) -> dict[str, float]:
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
    share = {
        "engine": engine / total,
        "cpu": cpu / total,
        "node_disk": (disk - bucket) / total,
        "bucket": bucket / total,
    }
    share["computed"] = max(0.0, 1.0 - sum(share.values()))
    return share


def _routing(turns: list[RoutedTurn]) -> dict[str, float]:
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
    out: dict[str, float] = {f"requests_node{n}": sum(t.server == n for t in turns) for n in range(NODES)}
    out["same_node_share"] = same / follow if follow else 0.0
    out["route_ms_mean"] = 1000 * statistics.fmean(t.route_s for t in turns) if turns else 0.0
    scored = [t for t in turns if t.route.prompt_tokens is not None]
    if scored:
        out["tie_share"] = sum(t.route.tied for t in scored) / len(scored)
        out["tokenize_ms_mean"] = 1000 * statistics.fmean(t.route.tokenize_s for t in scored)
        out["query_ms_mean"] = 1000 * statistics.fmean(t.route.query_s for t in scored)
        out["token_mismatches"] = sum(t.route.prompt_tokens != t.record.prompt_tokens for t in scored)
    return out


class _Accounts:
    """CPU seconds so far of labelled process groups (every process in them) and single processes."""

    def __init__(self, groups: dict[str, int], pids: dict[str, int]) -> None:
        self._groups = groups
        self._pids = pids

    def cpu_s(self) -> dict[str, float]:
        tick = float(os.sysconf("SC_CLK_TCK"))
        label_of_group = {pgid: label for label, pgid in self._groups.items()}
        label_of_pid = {pid: label for label, pid in self._pids.items()}
        out = dict.fromkeys([*self._groups, *self._pids], 0.0)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            fields = _stat_fields(int(entry))
            if fields is None:
                continue
            seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (all threads)
            label = label_of_pid.get(int(entry)) or label_of_group.get(int(fields[2]))  # [2]: group
            if label is not None:
                out[label] += seconds
        times = os.times()
        out["client"] = times.user + times.system
        return out


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name; None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}


def _settle(caches: list[NVMeCache], deadline: float) -> None:
    """Wait until the node agents' admissions of object hits are done: the caches stop growing."""
    counts = [c.usage().entries for c in caches]
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < _SETTLE_S and time.perf_counter() < deadline:
        time.sleep(0.2)
        now = [c.usage().entries for c in caches]
        if now != counts:
            counts, quiet_since = now, time.monotonic()


def _uploaded_keys(cache: NVMeCache) -> set[str]:
    """Chunks this node uploaded, from its change log (the node agent keeps the last 200,000 changes)."""
    keys: set[str] = set()
    seq = 0
    while changes := cache.changes_since(seq):
        keys.update(c.key for c in changes if c.kind is ChangeKind.UPLOADED)
        seq = changes[-1].seq + 1
    return keys


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
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "fleet.json", out_dir / "fleet.png"
    json_path.write_text(report.to_json())
    plot_report(report, png_path, title)
    return json_path, png_path


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = report.methods
    names = [m.method for m in methods]
    xs = list(range(len(methods)))
    fig, axes = plt.subplots(2, 2, figsize=(11, 9))
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
