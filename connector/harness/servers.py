"""Several vLLM OpenAI servers (`vllm_server`) started at once, for benchmarks that stand for a fleet.

Each server is started and later stopped by a thread of its own that holds its `vllm_server` block open
until this block exits: starts overlap (an engine's start waits on subprocesses and sockets much of the
time), and the thread that started a server lives as long as the server does, which its parent-death signal
needs (Linux sends it when the *thread* that forked the child ends). If any server fails to start, the others
are stopped and the first error is raised; every server is stopped when the block exits, however it exits.
A server can be confined to some CPUs (`ServerSpec.cpus`): its holder thread takes that affinity before it
starts the server, whose processes inherit it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.connector.harness.vllm_server import VLLMServer, vllm_server

__all__ = ["ServerSpec", "vllm_servers"]


@dataclass(frozen=True)
class ServerSpec:
    """The arguments of one `vllm_server`."""

    model_dir: Path
    kv_transfer_config: dict[str, Any] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    extra_args: Sequence[str] = ()
    log_path: Path | None = None
    startup_timeout_s: float = 300
    # CPUs the server's processes may run on (Linux), inherited by everything it starts: a node's own cores
    # when servers stand for nodes. None: wherever the caller may.
    cpus: frozenset[int] | None = None


class _Holder(threading.Thread):
    def __init__(self, spec: ServerSpec, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.spec = spec
        self.server: VLLMServer | None = None
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.release = threading.Event()

    def run(self) -> None:
        spec = self.spec
        try:
            if spec.cpus is not None:
                os.sched_setaffinity(0, spec.cpus)  # this thread's, which the server inherits
            with vllm_server(
                spec.model_dir,
                kv_transfer_config=spec.kv_transfer_config,
                env=spec.env,
                extra_args=spec.extra_args,
                log_path=spec.log_path,
                startup_timeout_s=spec.startup_timeout_s,
            ) as server:
                self.server = server
                self.started.set()
                self.release.wait()
        except BaseException as exc:  # handed to the caller's thread
            self.error = exc
        finally:
            self.started.set()


@contextlib.contextmanager
def vllm_servers(specs: Sequence[ServerSpec]) -> Iterator[list[VLLMServer]]:
    """Start every server of `specs` at once; the running servers, in order (see the module docstring)."""
    holders = [_Holder(spec, f"vllm-server-{i}") for i, spec in enumerate(specs)]
    try:
        for holder in holders:
            holder.start()
        for holder in holders:
            holder.started.wait()
        for holder in holders:
            if holder.error is not None:
                raise holder.error
        yield [h.server for h in holders if h.server is not None]
    finally:
        for holder in holders:
            holder.release.set()
        for holder in holders:
            if holder.is_alive():
                holder.join()
