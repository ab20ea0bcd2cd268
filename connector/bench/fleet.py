"""`kvstore bench fleet`: two vLLM servers standing for two nodes, conversations whose turns land on either.

The workload of `kvstore bench multiturn` (every conversation active at once, each turn resending the whole
history), sent to two real vLLM OpenAI servers, each with its own engine KV cache, CPU tier and local
directory (nodes share no disk). Methods, each on fresh servers and directories:

- `fs-rr`: round-robin, vLLM's `fs` tier on each node (two separate directories);
- `ours-rr`: round-robin, KVStoreTier on each node (its own NVMe cache and node agent), one shared bucket;
- `ours-aware`: KVStoreTier as above, each turn sent where NVIDIA Dynamo's KV indexer's credit and the
  servers' load together make it cheapest, as Dynamo's router decides (engines publish KV events, the tier's
  included; tiers weighted as Dynamo's router weighs them, see `harness.routed`);
- `obj-rr`: round-robin, vLLM's own object-store tier (`obj`, NIXL) on each node, the same S3 server and a
  shared prefix: the direct peer of `ours-rr`;
- `fs-shared-rr`: round-robin, vLLM's `fs` tier on one directory both nodes share: a shared file system at
  local-disk speed with no server, the most any shared store could give this workload on this machine: a
  bound for `ours-rr`, not a deployment (the only method whose nodes share a disk).

Round-robin sends a conversation's turns to the two nodes in turn: with `fs`, a node can reuse only what it
computed itself two turns earlier; with ours, the other node's last turn is in the bucket once its node agent
uploaded it. Cache-aware routing keeps a conversation where its KV is.

Per method: prompt tokens/s (cache hits included) and requests/s over the wall time, TTFT mean and p90 as the
client sees it (routing included), where the prompt tokens came from (`vllm:prompt_tokens_cached_by_source`:
engine, CPU tier, storage; the storage part split between our NVMe and the bucket by our tier's chunk hits),
cross-node chunks (chunks a node fetched from the bucket that the other node uploaded, from each node's
change log and NVMe cache), CPU seconds per process (each server's process group, each node agent, the S3
server, the indexer, this client), for the methods on S3 the requests the server counted per chunk loaded
and stored, and, for ours, how long the upload journals took to drain after the last turn. Sizing as in
multiturn: each node's engine KV cache and CPU tier too small for the conversations, so turns must come from
storage; the NVMe cache large enough never to evict (as a node's disk would be).

This module runs the methods, one after the other, each on nodes `fleet_nodes` sets up; `fleet_report` works
out the figures and writes the report; `fleet_cli` is the command.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvstore.agent.uploads import wait_uploaded
from kvstore.cache import ChangeKind, NVMeCache
from kvstore.connector.bench.fleet_nodes import NODES, Nodes, cpu_delta, node_cpus
from kvstore.connector.bench.fleet_report import FleetReport, MethodResult, method_result, tier_chunks
from kvstore.connector.bench.multiturn import Sizing, conversation_tokens
from kvstore.connector.bench.outputs import redact_logs
from kvstore.connector.bench.target import StoreTarget, cores_for
from kvstore.connector.harness.multiturn import Workload, replay
from kvstore.connector.harness.routed import RoutedTurn, Router, replay_routed
from kvstore.connector.harness.router import DynamoIndexer, dynamo_indexer
from kvstore.connector.harness.servers import vllm_servers
from kvstore.connector.harness.vllm_server import VLLMServer

__all__ = ["DESCRIPTIONS", "METHODS", "TIERS", "run_fleet"]

TIERS = {  # each method's tier on its nodes (`Nodes`), in the order `run_fleet` runs them by default
    "fs-rr": "fs",
    "ours-rr": "ours",
    "ours-aware": "ours",
    "obj-rr": "obj",
    "fs-shared-rr": "fs-shared",
}
METHODS = tuple(TIERS)
DESCRIPTIONS = {
    "fs-rr": "round-robin, vLLM fs tier per node",
    "ours-rr": "round-robin, ours (shared bucket)",
    "ours-aware": "cache- and load-aware (Dynamo indexer), ours",
    "obj-rr": "round-robin, vLLM obj tier (shared bucket)",
    "fs-shared-rr": "round-robin, vLLM fs tier on one shared directory (the bound)",
}
_OURS = tuple(m for m, tier in TIERS.items() if tier == "ours")
_S3 = tuple(m for m, tier in TIERS.items() if tier in ("ours", "obj"))  # the methods on the bucket
_SETTLE_S = 2.0  # admissions are done once the NVMe caches stopped growing this long


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
    server_core: bool = False,
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
    bind to the same cores (vLLM binds every engine to all of them) and spin against each other.

    `server_core`: the store's local S3 server (and the link before it) on the last core for every method,
    the nodes on the others, as if the bucket were served elsewhere (`server_apart`; `CoresUnavailable` at
    once when that cannot be done); the methods without a bucket get the same cores, the last one idle."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    if store is None and any(m in _S3 for m in methods):
        raise ValueError(f"methods {', '.join(_S3)} need a store target")
    if server_core and not pin_nodes:
        raise ValueError("a core of its own for the server needs the nodes pinned to the others")
    apart = cores_for(store, server_core)
    footprint = conversation_tokens(workload)
    report = FleetReport(
        workload=asdict(workload),
        sizing=asdict(sizing),
        nvme_bytes=nvme_bytes,
        tier_options=dict(tier_options or {}),
        node_cpus=node_cpus(spare_last=server_core) if pin_nodes else [[] for _ in range(NODES)],
        conversation_tokens=footprint,
        engine_conversations=sizing.engine_kv_bytes / sizing.kv_bytes_per_token / footprint,
        cpu_conversations=sizing.cpu_bytes / sizing.kv_bytes_per_token / footprint,
        link=store.link if store else "",
    )
    began = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-fleet-", dir=workdir))
    try:
        with apart as (server_cpus, _):
            report.server_cpus = sorted(server_cpus)
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
    """One method: its nodes and indexer, its replay, its figures, the upload drain after it."""

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
        self.workload = workload
        self.root = root
        self.log_dir = log_dir
        self.ours = method in _OURS
        self.store = store if method in _S3 else None
        self.nodes = Nodes(
            method,
            tier=TIERS[method],
            aware=method == "ours-aware",
            model_dir=model_dir,
            sizing=sizing,
            store=store,
            nvme_bytes=report.nvme_bytes,
            tier_options=report.tier_options,
            cpus=report.node_cpus,
            root=root,
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
        began = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if self.ours:
                # Registered first, so it runs last: after the servers stopped, which would start new agents.
                stack.callback(self.nodes.stop_agents, logs, keep_logs=self.log_dir is not None)
            indexer: DynamoIndexer | None = None
            if self.nodes.aware:
                indexer = stack.enter_context(dynamo_indexer(log_path=logs / f"{self.method}-indexer.log"))
            servers = stack.enter_context(vllm_servers(self.nodes.specs(logs)))
            progress(f"{self.method}: servers up in {time.perf_counter() - began:.0f} s")
            router = self.nodes.router(servers, indexer)
            for node, server in enumerate(servers):  # one-off costs of the first requests: not measured
                asyncio.run(replay(server.base_url, server.model, self.workload.warmup(seed=1000 + node)))
            if on_method_start is not None:
                on_method_start(self.method, self.workload.conversations * self.workload.turns)
            result = self._measure(servers, indexer, router, drain_timeout_s, progress, on_turn)
            stopping = time.perf_counter()
        progress(f"{self.method}: everything it started stopped in {time.perf_counter() - stopping:.0f} s")
        if self.store is not None:  # vLLM logs its kv_transfer_config, the obj tier's keys included
            redact_logs(logs, [self.store.secret_key, self.store.access_key])
        return result

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
        accounts = self.nodes.accounts(servers, indexer)
        before = [s.metrics() for s in servers]
        cpu_before = accounts.cpu_s()
        urls = [s.base_url for s in servers]
        requests_before = self.store.requests() if self.store is not None else None
        turns = asyncio.run(replay_routed(urls, servers[0].model, workload, router, on_turn))
        cpu_after = accounts.cpu_s()
        time.sleep(1.5)  # the engines publish their counters at the end of a step; let the last ones land
        after = [s.metrics() for s in servers]
        result = method_result(
            self.method, turns, before, after, ours=self.ours, bucket_only=self.method == "obj-rr"
        )
        requests_after = self.store.requests() if self.store is not None else None
        if requests_before is not None and requests_after is not None:
            result.s3_requests = asdict(requests_after - requests_before)
            result.chunks_loaded, result.chunks_stored = tier_chunks(before, after, self.nodes.sizing)
        result.cpu_s = cpu_delta(cpu_before, cpu_after)
        result.prompt_tokens_per_cpu_s = result.prompt_tokens / max(0.01, sum(result.cpu_s.values()))
        if self.ours:
            self._drain(result, drain_timeout_s, progress)
            result.drain_cpu_s = cpu_delta(cpu_after, accounts.cpu_s())
        return result

    def _drain(self, result: MethodResult, timeout_s: float, progress: Callable[[str], None]) -> None:
        """The journals' drain after the last turn, then what crossed nodes through the bucket."""
        with contextlib.ExitStack() as stack:
            caches = [stack.enter_context(NVMeCache(d, self.nodes.nvme_bytes)) for d in self.nodes.cache_dirs]
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
