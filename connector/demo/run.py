"""`kvstore demo`: the whole system on one machine, in one command.

It starts the embedded S3 server (or uses the configured store), the admin service and a vLLM OpenAI server
(CPU backend, the tiny local model) whose KV cache and CPU tier are far too small for the conversations it
is sent, with KVStoreTier behind them. Then:

1. a long "returning user" prompt is sent once (recomputed, and stored by the tier);
2. a short multi-turn replay runs with a progress bar: every conversation resends its whole history, and the
   others push it out of the engine and the CPU tier in between, so later turns come back from our tier;
3. the returning user's prompt is sent again (served from our tier), and once more with a `cache_salt`,
   which no cache can match, so the engine recomputes it: the TTFT saved, measured in the same run;
4. a second engine starts with an empty NVMe cache, standing for a new node that joins the fleet: the
   returning user's prompt comes back to it from the bucket (object-store hits), again beside a recompute on
   that same engine. It is asked for several returning users' prompts, each from the bucket and then
   recomputed, and the medians are shown: one request on two shared cores is one sample of noise.

Everything it starts is stopped on exit, on an error or on Ctrl-C (an `ExitStack` unwinds it), and the vLLM
server's leftovers in /dev/shm and /tmp are removed by `vllm_server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import SecretStr

from kvstore.agent.supervisor import stop_agent, wait_agent_up
from kvstore.agent.uploads import wait_uploaded
from kvstore.cache import NVMeCache
from kvstore.config import GiB, Settings
from kvstore.connector.bench.multiturn import Sizing
from kvstore.connector.harness.metrics import metric_delta
from kvstore.connector.harness.multiturn import TurnRecord, Workload, replay
from kvstore.connector.harness.tiny_model import TinyModelSpec, build_tiny_model, sample_text
from kvstore.connector.harness.vllm_server import VLLMServer, vllm_server
from kvstore.engine.timeline import LOOKUP, Phase, episode_phases, read_timelines
from kvstore.runtime import open_node
from kvstore.storage import EMBEDDED_BUCKET, open_object_store
from kvstore.stores import ObjectStore

__all__ = ["DemoOptions", "DemoReport", "demo_sizing", "run_demo"]

DEMO_PREFIX = "demo"


@dataclass(frozen=True)
class DemoOptions:
    conversations: int = 6
    context_tokens: int = 1500
    turn_tokens: int = 200
    turns: int = 3
    output_tokens: int = 16
    concurrency: int = 3
    # Long enough that recomputing it costs what a real returning history does (at 3,000 the new node's
    # bucket load was only 1.5x faster than recomputing on an AVX-512 machine; 2.7x at 6,000).
    returning_user_tokens: int = 6000
    # Returning users whose prompts the new node gets from the bucket (and recomputes): the medians count.
    new_node_users: int = 3
    admin_port: int | None = None  # None: settings.admin_port, or a free port when that one is taken


@dataclass
class TierCounts:
    queries: float
    hits: float

    @property
    def rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


@dataclass
class DemoReport:
    admin_url: str
    vllm_url: str
    turns: list[TurnRecord] = field(default_factory=list)
    # All the demo's prompt tokens by where they came from: device (engine prefix cache), host (CPU tier),
    # disk (our tier); the rest was computed.
    token_sources: dict[str, float] = field(default_factory=dict)
    prompt_tokens: float = 0.0
    kvstore_tiers: dict[str, TierCounts] = field(default_factory=dict)
    returning_cold_s: float = 0.0  # first time: recomputed
    returning_hit_s: float = 0.0  # again, after the replay pushed it out of the engine and the CPU tier
    returning_recompute_s: float = 0.0  # again, with a cache_salt: recomputed, same engine, same moment
    returning_hit_tokens: int = 0  # of the prompt, how many tokens came from a cache
    # A new node: a second engine whose NVMe cache starts empty, serving the returning user from the bucket.
    new_node_url: str = ""
    new_node_hits_s: list[float] = field(default_factory=list)  # per returning user, from the bucket
    new_node_recomputes_s: list[float] = field(default_factory=list)  # the same prompts with a cache_salt
    new_node_hit_tokens: int = 0  # the fewest prompt tokens any of them got from a cache
    new_node_tiers: dict[str, TierCounts] = field(default_factory=dict)
    # Where the new node's median request (the upper one of an even count) went, from the tier's timeline.
    new_node_phases: list[Phase] = field(default_factory=list)

    @property
    def new_node_hit_s(self) -> float:
        return statistics.median_high(self.new_node_hits_s) if self.new_node_hits_s else 0.0

    @property
    def new_node_recompute_s(self) -> float:
        return statistics.median_high(self.new_node_recomputes_s) if self.new_node_recomputes_s else 0.0

    @property
    def ttft_by_turn(self) -> dict[int, float]:
        turns = sorted({r.turn for r in self.turns})
        return {t: statistics.fmean(r.ttft_s for r in self.turns if r.turn == t) for t in turns}


def demo_sizing(options: DemoOptions) -> Sizing:
    """An engine KV cache of about one long request and a CPU tier of about one more: the replay's
    conversations (and the returning user) cannot all stay above our tier, the regime the product is for."""
    spec = TinyModelSpec()
    per_token = spec.num_layers * 2 * spec.num_kv_heads * (spec.hidden_size // spec.num_heads) * 2  # bf16
    longest = max(
        options.returning_user_tokens,
        options.context_tokens + options.turns * (options.turn_tokens + options.output_tokens + 32),
    )
    max_model_len = -(-(longest + 256) // 1024) * 1024
    return Sizing(
        # vLLM needs room for one full-length request and then some (block and per-layer rounding).
        engine_kv_bytes=3 * max_model_len * per_token // 2,
        cpu_bytes=max_model_len * per_token,
        kv_bytes_per_token=per_token,
        max_model_len=max_model_len,
        max_num_seqs=options.concurrency + 1,
        max_num_batched_tokens=max_model_len,
    )


def run_demo(
    settings: Settings,
    options: DemoOptions,
    *,
    say: Callable[[str], None] = print,
    on_turn: Callable[[TurnRecord], None] | None = None,
    hold: Callable[[DemoReport], None] | None = None,
) -> DemoReport:
    """Run the demo; `hold(report)` runs while everything is still up (e.g. wait for Ctrl-C)."""
    demo_dir = settings.data_dir / "demo"
    with contextlib.ExitStack() as stack:
        say("building the tiny local model (once)")
        model = build_tiny_model(demo_dir / "tiny-llama")

        store, server = open_object_store(settings, subprefix=DEMO_PREFIX)
        if server is not None:
            forgotten = _forget_earlier_runs(store)
            if forgotten:
                say(f"removed {forgotten} objects that earlier demo runs left in the embedded server")
        store.close()
        if server is not None:
            stack.callback(server.stop)
            store_url = f"s3://{EMBEDDED_BUCKET}/{DEMO_PREFIX}"
            endpoint: str | None = server.endpoint
            credentials = {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}
            say(f"embedded S3 server at {server.endpoint} (data in {settings.data_dir / 's3'})")
        else:
            store_url = f"{settings.local_store_url.rstrip('/')}/{DEMO_PREFIX}"
            endpoint, credentials = settings.s3_endpoint, {}
            say(f"object store: {store_url}")
        node_settings = settings.model_copy(
            update={
                "store_url": store_url,
                "s3_endpoint": endpoint,
                "cache_dir": demo_dir / "nvme",
                "cache_bytes": 2 * GiB,
                **(
                    {"access_key": SecretStr(server.access_key), "secret_key": SecretStr(server.secret_key)}
                    if server is not None
                    else {}
                ),
            }
        )
        node = open_node(node_settings)
        stack.callback(node.close)
        admin_url = stack.enter_context(_admin_service(node, settings.admin_host, _port(settings, options)))
        say(f"admin service at {admin_url} (API docs at {admin_url}/docs)")

        sizing = demo_sizing(options)
        tier: dict[str, Any] = {
            "type": "KVStoreTier",
            "module_path": "kvstore.connector.tier",
            "store_url": store_url,
            "cache_dir": str(node_settings.cache_dir),
            "cache_bytes": node_settings.cache_bytes,
        }
        if endpoint:
            tier["s3_endpoint"] = endpoint
        say("starting vLLM (CPU backend, tiny model) with KVStoreTier behind a small KV cache and CPU tier")
        vllm = stack.enter_context(
            vllm_server(
                model,
                kv_transfer_config=sizing.tiering_config(tier),
                env=credentials,
                extra_args=sizing.server_args(),
                log_path=demo_dir / "vllm.log",
            )
        )
        report = DemoReport(admin_url=admin_url, vllm_url=vllm.base_url)
        users = [
            sample_text(options.returning_user_tokens, seed=secrets.randbelow(1 << 30))
            for _ in range(max(1, options.new_node_users))
        ]
        returning = users[0]

        before = vllm.metrics()
        say("returning users' long prompts, first visit (recomputed, then stored by the tier)")
        report.returning_cold_s, _ = _ttft(vllm, returning)
        for other in users[1:]:
            _ttft(vllm, other)
        workload = Workload(
            conversations=options.conversations,
            context_tokens=options.context_tokens,
            turn_tokens=options.turn_tokens,
            turns=options.turns,
            output_tokens=options.output_tokens,
            concurrency=options.concurrency,
            seed=secrets.randbelow(1 << 20),  # fresh texts each run: the replay starts cold
        )
        report.turns = asyncio.run(replay(vllm.base_url, vllm.model, workload, on_turn))

        say("the returning user comes back: once as is, once with a cache_salt (forced recompute)")
        report.returning_hit_s, report.returning_hit_tokens = _ttft(vllm, returning)
        report.returning_recompute_s, _ = _ttft(vllm, returning, cache_salt=secrets.token_hex(8))
        time.sleep(1.5)  # counters are published at the end of an engine step
        _read_counts(report, before, vllm.metrics())

        say("a new node joins: a second engine with an empty NVMe cache, the same bucket")
        # Everything the first engine stored must be in the bucket before the new node asks for it.
        _wait_for_uploads(node)
        new_cache = demo_dir / "nvme-new-node"
        shutil.rmtree(new_cache, ignore_errors=True)
        timeline = demo_dir / "new-node-timeline.jsonl"
        timeline.unlink(missing_ok=True)
        new_tier = {**tier, "cache_dir": str(new_cache), "timeline_path": str(timeline)}
        # The node agent the new node's tier starts outlives its engine (it exits once idle): stop it once
        # the engine has stopped, so that the demo leaves no process behind.
        stack.callback(stop_agent, new_cache)
        second = stack.enter_context(
            vllm_server(
                model,
                kv_transfer_config=sizing.tiering_config(new_tier),
                env=credentials,
                extra_args=sizing.server_args(),
                log_path=demo_dir / "vllm-new-node.log",
            )
        )
        report.new_node_url = second.base_url
        wait_agent_up(new_cache, timeout_s=60.0)  # a real node's agent runs long before its first request
        new_node_cache = NVMeCache(new_cache, node_settings.cache_bytes)  # to wait for its uploads
        stack.callback(new_node_cache.close)
        say("the returning users reach the new node: served from the bucket, then recomputed for comparison")
        # Its first request pays the server's own first-request costs; a short unrelated one takes them, so
        # the TTFTs below compare the bucket with recomputation only.
        _ttft(second, sample_text(50, seed=secrets.randbelow(1 << 30)))
        fresh = second.metrics()
        served: list[tuple[float, int, list[Phase]]] = []
        for user in users:
            sent = time.monotonic()
            hit_s, hit_tokens = _ttft(second, user)
            served.append((hit_s, hit_tokens, _phases(timeline, sent, sent + hit_s)))
            report.new_node_recomputes_s.append(_ttft(second, user, cache_salt=secrets.token_hex(8))[0])
            # The recomputed prompt is stored and uploaded: not while the next user's GETs run.
            wait_uploaded(new_node_cache, timeout_s=120.0)
        report.new_node_hits_s = [hit_s for hit_s, _, _ in served]
        report.new_node_hit_tokens = min(tokens for _, tokens, _ in served)
        report.new_node_phases = sorted(served, key=lambda s: s[0])[len(served) // 2][2]
        time.sleep(1.5)
        report.new_node_tiers = _tier_counts(fresh, second.metrics())
        if hold is not None:
            hold(report)
    return report


def _forget_earlier_runs(store: ObjectStore) -> int:
    """Delete what earlier demo runs stored (their prompts were random: no run asks for them again, and on the
    node's own server they piled up, 18,764 chunks in a few days here); how many objects went. Only for the
    embedded server: a store the operator configured is left as it is."""
    keys = [info.key for info in store.list()]
    if keys:
        store.delete_many(keys)
    return len(keys)


def _port(settings: Settings, options: DemoOptions) -> int:
    """The configured admin port if it is free, else (or for port 0) any free one."""
    wanted = settings.admin_port if options.admin_port is None else options.admin_port
    with socket.socket() as sock:
        try:
            sock.bind((settings.admin_host, wanted))
        except OSError:
            sock.bind((settings.admin_host, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _admin_service(node: Any, host: str, port: int) -> Iterator[str]:
    """The admin API on a thread of this process, stopped when the block exits."""
    import uvicorn

    from kvstore.admin.app import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(node), host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="kvstore-demo-admin", daemon=True)
    thread.start()
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the admin service did not start on {url}")
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _ttft(server: VLLMServer, prompt: str, cache_salt: str | None = None) -> tuple[float, int]:
    """TTFT of a one-token completion (prefill only), and how many prompt tokens came from a cache."""
    body: dict[str, Any] = {"model": server.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    start = time.perf_counter()
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    details = response.json().get("usage", {}).get("prompt_tokens_details") or {}
    return elapsed, int(details.get("cached_tokens") or 0)


def _wait_for_uploads(node: Any, timeout_s: float = 120.0) -> None:
    """Until the node's upload journal is empty (the node agent, hosted by the admin service here, uploads
    what every engine on the node stored)."""
    node.flush(timeout_s)


def _phases(path: Path, sent: float, answered: float) -> list[Phase]:
    """The phases of the request sent at ``sent`` (requests go one at a time): the first episode that began
    after it. The tier writes a request's timeline once vLLM reports it finished, which may come after the
    next request was sent, so the count of episodes written before cannot tell which is whose."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for episode in read_timelines(path):
            lookup = episode.milestones.get(LOOKUP)
            if lookup is not None and sent <= lookup.first_s <= answered:
                return episode_phases(episode, sent, answered)
        time.sleep(0.1)
    return []


def _tier_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, TierCounts]:
    return {
        tier: TierCounts(
            queries=metric_delta(before, after, "vllm:kvstore_chunk_queries_total", tier=tier),
            hits=metric_delta(before, after, "vllm:kvstore_chunk_hits_total", tier=tier),
        )
        for tier in ("nvme", "object")
    }


def _read_counts(report: DemoReport, before: dict[str, float], after: dict[str, float]) -> None:
    report.prompt_tokens = metric_delta(before, after, "vllm:prompt_tokens_total")
    report.token_sources = {
        source: metric_delta(before, after, "vllm:prompt_tokens_cached_by_source_total", source=source)
        for source in ("device", "host", "disk")
    }
    report.kvstore_tiers = _tier_counts(before, after)
