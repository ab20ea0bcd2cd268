"""Run a real vLLM (CPU) engine in a subprocess for connector tests.

Why a subprocess: vLLM starts its own engine-core process, installs signal handlers,
holds global state (Prometheus registry, distributed groups) and leaves files in /dev/shm
and /tmp. Keeping it out of the pytest process lets every test start a clean engine and
lets the harness clean up whatever the engine left, even when it crashes.

API (the only thing tests need)::

    run = run_engine(model_dir, prompts, kv_transfer_config=cfg, max_tokens=8)
    run.results[i].num_cached_tokens   # prefix-cache + connector hits for prompt i
    run.results[i].token_ids           # greedy (temperature 0) output tokens
    run.metric("vllm:external_prefix_cache_hits")   # engine metrics (LLM.get_metrics); a name
                                                    # vLLM does not declare raises UnknownMetric
    run.results[i].kv_digests          # with kv_digests=True: sha256 of the KV the engine holds
                                       # for each full block of prompt i, all layers
    run.start_s, run.wall_s            # engine start time, whole-subprocess time
    run.kv_events                      # with capture_kv_events=True: decoded KVEventBatch
                                       # dicts, e.g. {"type": "BlockStored", "medium": ...}

Prompts run one ``generate`` call at a time, in order, so a later prompt sees what an
earlier one stored. The subprocess runs ``engine_child.py``; inside ``forkserver.forked_vllm()`` (the
test suite) it is a fork of a process that imported vLLM already.

Why KV digests: greedy tokens of the tiny model hardly depend on early context, so equal output
proves nothing about the bytes a tier loaded. The digests are of the engine's own KV-cache blocks
after the request ran (read through the CPU worker's block views, so ``CPUTieringSpec`` must be
configured): a block loaded from a tier must be bit-identical to the block a cold engine computed
for the same tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.connector.harness import engine_child, forkserver
from kvstore.connector.harness.forkserver import ChildProcess
from kvstore.connector.harness.metrics import metric_total

__all__ = [
    "EngineError",
    "EngineRun",
    "RequestResult",
    "UnknownMetric",
    "new_shm",
    "remove_new_shm",
    "run_engine",
    "shm_in_use",
    "shm_snapshot",
    "vllm_child_env",
]

SHM = Path("/dev/shm")
# What vLLM and torch make there: offload regions, shared-memory buffers and queues, semaphores, KMP locks.
_VLLM_SHM = ("vllm", "psm_", "torch_", "sem.mp-", "sem.loky-", "wrk_", "__KMP")


@dataclass(frozen=True)
class RequestResult:
    """What one prompt produced."""

    prompt_len: int
    num_cached_tokens: int
    token_ids: list[int]
    text: str
    # Per output position: {token_id: logprob} of the top candidates (when requested).
    logprobs: list[dict[int, float]] | None = None
    # With kv_digests=True: sha256 (hex) of each full prompt block's KV in the engine, all layers.
    kv_digests: list[str] | None = None


@dataclass
class EngineRun:
    """Outcome of one engine subprocess."""

    results: list[RequestResult]
    # Flat snapshot: "name" or "name{label=value,...}" -> value (histograms: _count, _sum).
    metrics: dict[str, float]
    start_s: float
    generate_s: list[float]
    wall_s: float
    # Per prompt: time.monotonic() when its generate call started and ended (tier timelines use that clock).
    generate_at: list[tuple[float, float]] = field(default_factory=list)
    # Events published over ZMQ (capture_kv_events=True), each a plain dict with a "type".
    kv_events: list[dict[str, Any]] = field(default_factory=list)
    # What the engine left in /dev/shm and its private TMPDIR (removed by the harness).
    leftovers: list[str] = field(default_factory=list)
    log_tail: str = ""
    # Every metric name the engine's registry declares (histograms as name_count and name_sum), whether
    # or not it has a sample yet.
    metric_names: frozenset[str] = frozenset()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric over every label set that includes ``labels``: 0 for a declared metric that has
        counted nothing (yet) for them; ``UnknownMetric`` for a name the engine does not declare, so a
        renamed or lost metric fails the test instead of reading as 0."""
        if name not in self.metric_names:
            similar = sorted(n for n in self.metric_names if n[:12] == name[:12])
            raise UnknownMetric(f"the engine declares no metric {name!r} (similar: {similar})")
        return metric_total(self.metrics, name, **labels)


class EngineError(RuntimeError):
    """The engine subprocess failed; the message carries its log tail."""


class UnknownMetric(LookupError):
    """A metric name the engine does not declare (renamed, or never registered)."""


def vllm_child_env(child_tmp: Path, extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of a vLLM subprocess: offline, no telemetry, temp files (ZMQ ipc sockets among them)
    in `child_tmp` so they go away with it; `extra` last."""
    return {
        **os.environ,
        "TMPDIR": str(child_tmp),
        "VLLM_RPC_BASE_PATH": str(child_tmp),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **extra,
    }


def shm_snapshot() -> set[str]:
    """Names in /dev/shm (vLLM leaves offload regions and shared-memory buffers there)."""
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def new_shm(before: set[str], *, settle_s: float = 30.0) -> set[str]:
    """vLLM's and torch's /dev/shm entries made since `before` that no live process holds and that are still
    there after up to `settle_s`: what engines that have stopped left behind. An engine running meanwhile
    (another test's, a benchmark's) holds its own; one that stopped meanwhile may leave entries free for a
    moment before its own harness removes them, so a free entry counts only once it outlasts the wait."""
    deadline = time.monotonic() + settle_s
    while True:
        left = {name for name in shm_snapshot() - before - shm_in_use() if name.startswith(_VLLM_SHM)}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.5)


def run_engine(
    model: str | os.PathLike[str],
    prompts: list[str] | list[list[int]],
    *,
    kv_transfer_config: dict[str, Any] | None = None,
    kv_events_config: dict[str, Any] | None = None,
    capture_kv_events: bool = False,
    max_tokens: int = 8,
    logprobs: int | None = None,
    kv_digests: bool = False,
    max_model_len: int = 8192,
    kv_cache_bytes: int = 256 * 2**20,
    settle_s: float = 1.0,
    pause_s: float = 0.0,
    between: Callable[[int], None] | None = None,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    engine_args: dict[str, Any] | None = None,
) -> EngineRun:
    """Start an engine in a subprocess, run ``prompts`` one by one, shut it down, clean up.

    ``settle_s`` is slept after the last prompt so asynchronous offloads (primary tier ->
    secondary tiers) finish before shutdown; the engine keeps stepping while the tiering
    manager reports pending work. ``capture_kv_events`` enables vLLM's ZMQ event publisher
    on an ipc socket and subscribes to it inside the subprocess. ``between(i)`` runs in this
    process after prompt ``i`` finished and before prompt ``i + 1`` starts, while the engine
    waits (e.g. to stop a server mid-run). New /dev/shm entries and the engine's private
    TMPDIR are removed whatever happens. ``kv_digests`` records each request's KV blocks (see the
    module docstring; needs ``CPUTieringSpec`` in ``kv_transfer_config``). A failure to collect the
    metrics or the digests fails the run (``EngineError``).
    """
    spec = {
        "model": str(model),
        "prompts": prompts,
        "kv_transfer_config": kv_transfer_config,
        "kv_events_config": kv_events_config,
        "capture_kv_events": capture_kv_events,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "kv_digests": kv_digests,
        "max_model_len": max_model_len,
        "kv_cache_bytes": kv_cache_bytes,
        "settle_s": settle_s,
        "pause_s": pause_s,
        "between": between is not None,
        "engine_args": engine_args or {},
    }
    before = shm_snapshot()
    work = Path(tempfile.mkdtemp(prefix="kvstore-engine-"))
    child_tmp = work / "tmp"
    child_tmp.mkdir()
    (work / "spec.json").write_text(json.dumps(spec))
    child_env = vllm_child_env(
        child_tmp,
        {
            "VLLM_CONFIGURE_LOGGING": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in the subprocess itself
            **(env or {}),
        },
    )
    log_path = work / "engine.log"
    started = time.perf_counter()
    try:
        proc = _start(work, child_env, log_path)
        try:
            rc = _wait(proc, work, between, deadline=time.monotonic() + timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise EngineError(f"engine timed out after {timeout_s}s\n{_tail(log_path)}") from None
        _kill_group(proc)  # stragglers (engine core) that outlived the parent
        wall = time.perf_counter() - started
        out_path = work / "result.json"
        if rc != 0 or not out_path.exists():
            raise EngineError(f"engine exited with {rc}\n{_tail(log_path)}")
        out = json.loads(out_path.read_text())
        leftovers = sorted(str(SHM / n) for n in new_shm(before))
        leftovers += sorted(str(p) for p in child_tmp.iterdir())
        return EngineRun(
            results=[_request_result(r) for r in out["results"]],
            metrics=out["metrics"],
            start_s=out["start_s"],
            generate_s=out["generate_s"],
            generate_at=[tuple(pair) for pair in out.get("generate_at", [])],
            kv_events=out["kv_events"],
            metric_names=frozenset(out["metric_names"]),
            wall_s=wall,
            leftovers=leftovers,
            log_tail=_tail(log_path),
        )
    finally:
        remove_new_shm(before)
        shutil.rmtree(work, ignore_errors=True)


def _start(work: Path, env: dict[str, str], log_path: Path) -> ChildProcess:
    """The engine subprocess, leading a process group of its own (so that it can be killed whole); a fork of
    the preloaded process inside ``forked_vllm()``."""
    server = forkserver.active(env)
    if server is not None:
        return server.spawn(
            engine_child.__name__, [str(work)], env=env, log_path=log_path, status_path=work / "exit_status"
        )
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, engine_child.__file__, str(work)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _wait(proc: ChildProcess, work: Path, between: Callable[[int], None] | None, deadline: float) -> int:
    """Wait for the engine, running `between(i)` whenever it pauses after prompt i."""
    if between is None:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    handled = 0
    while True:
        rc = proc.poll()
        if rc is not None:
            return rc
        if (work / f"paused_{handled}").exists():
            between(handled)
            (work / f"resume_{handled}").touch()
            handled += 1
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, 0)
        time.sleep(0.05)


def _request_result(raw: dict[str, Any]) -> RequestResult:
    if raw.get("logprobs") is not None:  # JSON object keys are strings
        raw["logprobs"] = [{int(k): v for k, v in pos.items()} for pos in raw["logprobs"]]
    return RequestResult(**raw)


def _tail(path: Path, n: int = 6000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


def _kill_group(proc: ChildProcess) -> None:
    """Kill the session the engine subprocess leads (only processes we started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, 9)
    with contextlib.suppress(Exception):
        proc.wait(timeout=10)


def remove_new_shm(before: set[str], *, grace_s: float = 5.0) -> None:
    """Remove /dev/shm entries created during the run that look like vLLM's or torch's.

    An entry some live process still maps or holds open is waited for up to `grace_s` (the stopped engine's
    own children may still be exiting), then left alone: it belongs to another engine running at the same
    time (a benchmark beside the demo, say), not to the one that just stopped."""
    candidates = [name for name in shm_snapshot() - before if name.startswith(_VLLM_SHM)]
    deadline = time.monotonic() + grace_s
    while candidates:
        in_use = shm_in_use()
        for name in candidates:
            if name not in in_use:
                _remove_shm(SHM / name)
        candidates = [name for name in candidates if name in in_use]
        if time.monotonic() >= deadline:
            return
        if candidates:
            time.sleep(0.2)


def _remove_shm(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def shm_in_use() -> set[str]:
    """Names in /dev/shm that some live process maps or has open. Matched by inode: a POSIX semaphore is
    mapped under the temporary name it was created with, then linked to its real name."""
    inodes: set[int] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(str(SHM)):
                    inodes.add(int(fields[4]))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(str(SHM)):
                        inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
    used: set[str] = set()
    for name in shm_snapshot():
        with contextlib.suppress(OSError):
            if os.stat(SHM / name, follow_symlinks=False).st_ino in inodes:
                used.add(name)
    return used
