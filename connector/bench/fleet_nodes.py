"""The two nodes of a `bench fleet` method: each node's directories, CPUs, ports and vLLM server (its tier's
entry; KV events for the indexer when routed by cache), the router in front of them, the CPU seconds of every
process they run, and their node agents stopped (their logs kept) at the end."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from kvstore.agent.supervisor import LOG_NAME, agent_status, stop_agent, wait_agent_up
from kvstore.connector.bench.multiturn import Sizing
from kvstore.connector.bench.target import StoreTarget
from kvstore.connector.configs import CPU_BLOCK_TOKENS
from kvstore.connector.harness.routed import CacheAware, RoundRobin, Router, local_chat_tokenizer
from kvstore.connector.harness.router import DynamoIndexer
from kvstore.connector.harness.servers import ServerSpec
from kvstore.connector.harness.vllm_server import VLLMServer
from kvstore.ports import free_port

__all__ = ["NODES", "Accounts", "Nodes", "cpu_delta", "node_cpus"]

NODES = 2
_AGENT_START_S = 60.0


def node_cpus(*, spare_last: bool = False) -> list[list[int]]:
    """This process's CPUs split evenly between the nodes ([] each when there are fewer CPUs than nodes).
    ``spare_last``: all but the last, which the bucket's server takes (`server_apart`); fewer of them than
    nodes, and the nodes share them, as the nodes of a small machine share its cores."""
    cpus = sorted(os.sched_getaffinity(0))
    if spare_last:
        cpus = cpus[:-1]
        if 0 < len(cpus) < NODES:
            return [cpus for _ in range(NODES)]
    share = len(cpus) // NODES
    if share == 0:
        return [[] for _ in range(NODES)]
    return [cpus[i * share : (i + 1) * share] for i in range(NODES)]


class Nodes:
    """One method's nodes. `tier`: "ours" (KVStoreTier on each, one bucket prefix for both), "obj" (vLLM's
    object tier on each, one prefix for both), "fs" (vLLM's fs tier in a directory per node) or "fs-shared"
    (vLLM's fs tier on one directory both read and write); `aware`: routed by the indexer, so the engines
    (and our tier) publish KV events."""

    def __init__(
        self,
        method: str,
        *,
        tier: str,
        aware: bool,
        model_dir: Path,
        sizing: Sizing,
        store: StoreTarget | None,
        nvme_bytes: int,
        tier_options: dict[str, Any],
        cpus: list[list[int]],
        root: Path,
    ) -> None:
        self.method = method
        self.tier = tier
        self.ours = tier == "ours"
        self.aware = aware
        self.model_dir = model_dir
        self.sizing = sizing
        self.store = store
        self.nvme_bytes = nvme_bytes
        self.tier_options = tier_options
        self.node_cpus = cpus
        self.root = root
        self.cache_dirs = [root / f"node{i}" / "nvme" for i in range(NODES)]
        self.ports = [
            (free_port(), free_port()) for _ in range(NODES)
        ]  # each engine's KV events, their replay
        self.prefix = f"fleet-{method}-{time.time_ns()}"
        self.store_url = f"{store.store_url.rstrip('/')}/{self.prefix}" if store is not None else ""

    def specs(self, logs: Path) -> list[ServerSpec]:
        """Each node's server, its log under `logs`."""
        return [self._spec(node, logs) for node in range(NODES)]

    def _spec(self, node: int, logs: Path) -> ServerSpec:
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
        elif self.tier == "obj":
            assert self.store is not None
            tier, obj_env = self.store.obj_tier(self.prefix)
            env.update(obj_env)
        elif self.tier == "fs-shared":
            # A shared file system at local-disk speed: each node finds the other's files as soon as they
            # are renamed into place (vLLM's fs tier looks a chunk up by its file), and no server runs.
            tier = {"type": "fs", "root_dir": str(self.root / "shared-fs")}
        else:
            tier = {"type": "fs", "root_dir": str(node_dir / "fs")}
        config = self.sizing.tiering_config(tier)
        if self.aware:
            config["kv_connector_extra_config"]["self_describing_kv_events"] = True
            port, replay_port = self.ports[node]
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

    def router(self, servers: list[VLLMServer], indexer: DynamoIndexer | None) -> Router:
        """Round-robin; with an indexer, each engine registered with it and the router asking it."""
        if indexer is None:
            return RoundRobin(NODES)
        for node, (port, replay_port) in enumerate(self.ports):
            indexer.register(
                node + 1,
                f"tcp://127.0.0.1:{port}",
                model=servers[node].model,
                block_size=CPU_BLOCK_TOKENS,  # vLLM's block size, which the indexer must be told
                replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
            )
        return CacheAware(
            indexer,
            [n + 1 for n in range(NODES)],
            model=servers[0].model,
            block_size=CPU_BLOCK_TOKENS,  # vLLM's block size, which the indexer must be told
            tokenize=local_chat_tokenizer(self.model_dir),
        )

    def accounts(self, servers: list[VLLMServer], indexer: DynamoIndexer | None) -> Accounts:
        """Whose CPU seconds count: each server's process group, the indexer, the agents, the S3 server."""
        groups = {f"node{i} vLLM": s.process.pid for i, s in enumerate(servers)}
        pids: dict[str, int] = {}
        if indexer is not None:
            groups["indexer"] = indexer.process.pid
        if self.ours:
            for node, directory in enumerate(self.cache_dirs):
                # Each tier starts its node's agent as its engine comes up: on a busy machine it may still be
                # importing when the engines answer, and an agent not running yet would go uncounted.
                if not wait_agent_up(directory, timeout_s=_AGENT_START_S):
                    raise RuntimeError(f"node{node}'s agent did not start within {_AGENT_START_S:.0f} s")
                pid = agent_status(directory).pid
                if pid is not None:
                    pids[f"node{node} agent"] = pid
        if self.tier in ("ours", "obj") and self.store is not None and self.store.server_pid is not None:
            pids["S3 server"] = self.store.server_pid
        return Accounts(groups, pids)

    def stop_agents(self, logs: Path, *, keep_logs: bool) -> None:
        """Stop each node's agent; with `keep_logs`, its log is copied under `logs` first."""
        for node, directory in enumerate(self.cache_dirs):
            stop_agent(directory, timeout_s=10)  # returns once the agent's process is gone
            log = directory / LOG_NAME
            if keep_logs and log.exists():
                with contextlib.suppress(OSError):
                    shutil.copyfile(log, logs / f"{self.method}-node{node}-agent.log")


class Accounts:
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


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per label between two `Accounts.cpu_s` readings."""
    return {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
