"""The node agent's process: how an engine starts it (detached; it lowers its own priority, see
`kvstore.priority`) and how it is stopped. The lock, the status file and the engines' registration are the
node's shared contract (`kvstore.node`), re-exported here for the tools that stop or report on an agent.

``agent.log`` is what an agent started by an engine writes (it has no terminal).
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, SecretStr

from kvstore.config import Settings
from kvstore.node.agent_files import (
    HEARTBEAT_S,
    HUNG_S,
    LOCK_NAME,
    LOG_NAME,
    STATUS_NAME,
    AgentStatus,
    agent_status,
    lock_held,
    signal_agent,
)
from kvstore.node.private import PRIVATE_FILE, private_dir, tighten
from kvstore.processes import start_time

__all__ = [
    "HEARTBEAT_S",
    "HUNG_S",
    "LOCK_NAME",
    "LOG_NAME",
    "STATUS_NAME",
    "AgentStatus",
    "agent_status",
    "settings_payload",
    "spawn_agent",
    "stop_agent",
    "wait_agent_up",
]

log = logging.getLogger(__name__)

# -- starting and stopping -----------------------------------------------------------------------------

# Run by a short-lived interpreter between the engine and the agent: it forks the agent into a session of
# its own and exits at once, so the agent is nobody's child in the engine's process (nothing to reap, no
# thread left waiting there) and outlives it. The agent inherits the pipe its settings come on as stdin.
_DETACH = """
import os, sys
if os.fork() == 0:
    os.setsid()
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""
_DETACH_WAIT_S = 30.0


def spawn_agent(settings: Settings, *, exit_when_idle_s: float) -> None:
    """Start an agent for ``settings.cache_dir`` in a process of its own, detached from the caller (it
    outlives the engine that starts it). Returns once the agent's process exists; the agent reads its
    settings, secrets included, from a pipe, so none of them lands in a file, an argument list or the
    environment. Every path in them is absolute: the agent runs in ``/``."""
    directory = private_dir(Path(settings.cache_dir).absolute())
    command = [sys.executable, "-I", "-S", "-c", _DETACH, "-m", "kvstore.agent", "--settings-from-stdin"]
    command += ["--exit-when-idle", repr(exit_when_idle_s)]
    log_fd = os.open(directory / LOG_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE)
    tighten(directory / LOG_NAME)
    try:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=log_fd,
            stderr=log_fd,
            close_fds=True,
            cwd="/",
            env=_agent_environment(),
        )
    finally:
        os.close(log_fd)
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        _write_settings(settings, proc.stdin)
    try:
        proc.wait(_DETACH_WAIT_S)  # the intermediate only forks: it is gone at once, reaped here
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _agent_environment() -> dict[str, str]:
    """The caller's environment, with a relative KVSTORE_CONFIG_FILE made absolute (the agent runs in
    ``/``; the settings it needs come on its stdin, but it reads the file again as a source)."""
    env = dict(os.environ)
    config = env.get("KVSTORE_CONFIG_FILE")
    if config:
        env["KVSTORE_CONFIG_FILE"] = os.path.abspath(config)
    return env


def wait_agent_up(cache_dir: str | os.PathLike[str], *, timeout_s: float) -> bool:
    """Until the agent of ``cache_dir`` is up (it wrote its status); False if it was not by ``timeout_s``.
    On a node it runs long before the first request; its start (a Python process importing what it needs,
    a second or two of CPU) must not land in what a benchmark or the demo times."""
    deadline = time.monotonic() + timeout_s
    while agent_status(cache_dir).heartbeat_age_s is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop_agent(cache_dir: str | os.PathLike[str], *, timeout_s: float = 10.0) -> bool:
    """Stop the agent of ``cache_dir`` (SIGTERM, then SIGKILL after ``timeout_s``); True once none runs.
    The signal goes to the process the kernel says holds the lock, whatever ``agent.json`` says (or if it is
    gone), and only while that process still does; it may host other things (`kvstore serve`). The agent
    lets go of its lock before it exits and holds the node's files open until then: this returns once that
    process is gone too (or the same deadline passed), so the caller may remove the directory."""
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        status = agent_status(cache_dir)
        if not status.running:
            return True
        if not signal_agent(cache_dir, status, sig) and status.pid is None:
            return False  # the kernel does not say which process holds it
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not lock_held(cache_dir):
                _wait_exited(status.pid, status.process_start, deadline)
                return True
            time.sleep(0.05)
    return not lock_held(cache_dir)


def _wait_exited(pid: int | None, started: str | None, deadline: float) -> None:
    """Until the process that held the lock is gone (a zombie, or its pid reused, counts) or ``deadline``."""
    if pid is None or started is None:
        return
    while start_time(pid) == started and time.monotonic() < deadline:
        time.sleep(0.05)


def settings_payload(settings: Settings) -> bytes:
    """``settings`` as JSON, secrets in clear: for the agent's stdin only."""
    data = {name: _plain(getattr(settings, name)) for name in type(settings).model_fields}
    return json.dumps({k: v for k, v in data.items() if v is not None}).encode()


def _write_settings(settings: Settings, pipe: IO[bytes]) -> None:
    try:
        pipe.write(settings_payload(settings))
    finally:
        pipe.close()


def _plain(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, Path):
        return str(value.absolute())  # the agent runs in /: a relative path would name another place
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, BaseModel):  # a store spec
        return {
            k: _plain(getattr(value, k)) for k in type(value).model_fields if getattr(value, k) is not None
        }
    if isinstance(value, enum.Enum):
        return value.name.lower()  # the codec, by name
    return value
