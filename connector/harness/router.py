"""A real cache-aware router for tests: NVIDIA Dynamo's standalone KV indexer, in a subprocess of its own.

`ai-dynamo-runtime` (tested: 1.6.1, the `test` extra) ships it as ``python -m dynamo.indexer --port P``: an
HTTP service that subscribes to engines' ZMQ KV-event publishers and answers which instance holds how much of
a prompt, per tier. Usage::

    with dynamo_indexer() as router:
        router.register(7, "tcp://127.0.0.1:5557", model="m", block_size=128,
                        replay_endpoint="tcp://127.0.0.1:5558")
        router.credit(7, tokens, model="m")   # Credit(gpu=..., cpu=..., disk=...), tokens matched

What the indexer does, as far as these tests rely on it:

- ``POST /register`` connects a SUB socket to the engine's publisher (which must bind: vLLM's
  ``tcp://*:PORT``). Batches it missed before its first one (a late connection) are fetched from vLLM's
  replay socket when given; batches whose sequence number is not above the last one it applied are dropped
  as stale, which is what a restarted engine's are (vLLM counts from 0 again) until the instance is
  unregistered and registered again. The batch's `data_parallel_rank` names the rank the events apply to,
  so a second feed (GC's publisher) registered under the same instance with a spare `dp_rank` reaches the
  engine's rank 0.
- ``POST /query`` answers per instance ``gpu``, ``cpu`` and ``disk`` tokens matched, cumulative (``cpu``
  counts what the GPU or the CPU holds, ``disk`` any tier): `Credit` keeps them as reported.
- ``POST /unregister`` forgets the instance and everything it was credited with.

The process runs in its own process group and is stopped with it (SIGTERM, then SIGKILL); its log is kept
for failure messages (`log_tail`) in a temporary directory removed with it, unless `log_path` puts it
elsewhere.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvstore.ports import free_port

__all__ = ["Credit", "DynamoIndexer", "RouterError", "dynamo_indexer", "unavailable_reason"]

_MODULE = "dynamo.indexer"
_STOP_GRACE_S = 10.0


class RouterError(RuntimeError):
    """The indexer did not start, died, or refused a request; the message carries its log tail."""


@dataclass(frozen=True)
class Credit:
    """Tokens of a prompt the indexer credits one instance with, cumulative by tier as it reports them."""

    gpu: int = 0
    cpu: int = 0  # held by the GPU or the CPU tier
    disk: int = 0  # held by any tier, storage tiers included


def unavailable_reason() -> str | None:
    """Why the indexer cannot run here (for a skip), or None when it can."""
    try:
        found = importlib.util.find_spec(_MODULE) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return f"{_MODULE} is not importable: install ai-dynamo-runtime (the `test` extra pins 1.6.1)"
    return None


@dataclass
class DynamoIndexer:
    """A running indexer: its URL, its log and the requests the tests make."""

    base_url: str
    log_path: Path
    process: subprocess.Popen[bytes]

    def register(
        self,
        instance_id: int,
        endpoint: str,
        *,
        model: str,
        block_size: int,
        replay_endpoint: str | None = None,
        dp_rank: int | None = None,
    ) -> None:
        body: dict[str, Any] = {
            "instance_id": instance_id,
            "endpoint": endpoint,
            "model_name": model,
            "block_size": block_size,
        }
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        if dp_rank is not None:
            body["dp_rank"] = dp_rank
        self._post("/register", body)

    def unregister(self, instance_id: int, *, model: str) -> None:
        self._post("/unregister", {"instance_id": instance_id, "model_name": model})

    def credits(self, tokens: Sequence[int], *, model: str) -> dict[int, Credit]:
        """Every instance's credit for `tokens` (instances credited with nothing are left out)."""
        response = httpx.post(
            f"{self.base_url}/query", json={"token_ids": list(tokens), "model_name": model}, timeout=30
        )
        return self._credits(response)

    async def query(
        self, client: httpx.AsyncClient, tokens: Sequence[int], *, model: str
    ) -> dict[int, Credit]:
        """`credits` through a client the caller keeps open (`httpx.post` builds a client, TLS context
        included, per call: ~0.1 s of CPU, too much for a router in front of every request)."""
        response = await client.post(
            f"{self.base_url}/query", json={"token_ids": list(tokens), "model_name": model}, timeout=30
        )
        return self._credits(response)

    def _credits(self, response: httpx.Response) -> dict[int, Credit]:
        if response.status_code == 404 or "no indexer for model" in response.text:
            return {}  # nothing registered (any more) for the model
        self._check(response)
        out: dict[int, Credit] = {}
        for instance, row in response.json().get("instances", {}).items():
            out[int(instance)] = Credit(
                gpu=int(row.get("gpu", 0)), cpu=int(row.get("cpu", 0)), disk=int(row.get("disk", 0))
            )
        return out

    def credit(self, instance_id: int, tokens: Sequence[int], *, model: str) -> Credit:
        return self.credits(tokens, model=model).get(instance_id, Credit())

    def log_tail(self, n: int = 8000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def _post(self, path: str, body: dict[str, Any]) -> None:
        self._check(httpx.post(f"{self.base_url}{path}", json=body, timeout=30))

    def _check(self, response: httpx.Response) -> None:
        if response.status_code >= 400:
            raise RouterError(
                f"{response.request.method} {response.request.url.path} -> {response.status_code} "
                f"{response.text}\n{self.log_tail()}"
            )


@contextlib.contextmanager
def dynamo_indexer(*, log_path: Path | None = None, startup_timeout_s: float = 60) -> Iterator[DynamoIndexer]:
    """Run the indexer until the block exits (see the module docstring)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RouterError(reason)
    work = Path(tempfile.mkdtemp(prefix="kvstore-router-"))
    log_path = log_path or work / "indexer.log"
    port = free_port()
    env = {**os.environ, "NO_COLOR": "1", "RUST_LOG": os.environ.get("RUST_LOG", "info")}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", _MODULE, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    indexer = DynamoIndexer(f"http://127.0.0.1:{port}", log_path, proc)
    try:
        _wait_up(indexer, time.monotonic() + startup_timeout_s)
        yield indexer
    finally:
        _stop(proc)
        shutil.rmtree(work, ignore_errors=True)  # with the log, unless the caller put it elsewhere


def _wait_up(indexer: DynamoIndexer, deadline: float) -> None:
    with httpx.Client(timeout=2) as client:
        while True:
            rc = indexer.process.poll()
            if rc is not None:
                raise RouterError(f"{_MODULE} exited with {rc} during startup\n{indexer.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{indexer.base_url}/health").status_code < 500:
                    return
            if time.monotonic() > deadline:
                raise RouterError(f"{_MODULE} did not answer in time\n{indexer.log_tail()}")
            time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
