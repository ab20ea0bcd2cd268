"""One node agent per cache directory: the lock that makes it the only one, whether it runs, how an engine
starts it (detached, at idle priority) and how it is stopped.

Files in the cache directory:

=================  ===================================================================================
``agent.lock``     flock'ed by the running agent for as long as it runs; the kernel releases it when the
                   agent dies, however it dies, so a dead agent is simply replaced by the next start
``agent.json``     the running agent's pid, host and start time; its mtime is the agent's heartbeat
``agent.log``      what an agent started by an engine writes (it has no terminal)
``engines/<pid>``  one file per engine process using the cache; an agent that an engine started exits
                   once none of them is alive and the upload journal is empty
=================  ===================================================================================

An agent that holds the lock but has not beaten for ``HUNG_S`` while not runnable (a deadlock, not a
starved idle-priority process) is hung: the next agent to start kills it and takes over.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import fcntl
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, SecretStr

from kvstore.config import Settings
from kvstore.processes import alive, state

log = logging.getLogger(__name__)

LOCK_NAME = "agent.lock"
STATUS_NAME = "agent.json"
LOG_NAME = "agent.log"
ENGINES_DIR = "engines"
HEARTBEAT_S = 1.0
# An idle-priority agent on a saturated node may not run for many seconds: only a long silence while it is
# not even runnable means it is stuck.
HUNG_S = 120.0

_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_IDLE = 3
_IOPRIO_CLASS_SHIFT = 13
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}


@dataclass(frozen=True)
class AgentStatus:
    """Whether an agent holds the node's lock, and what it last said about itself."""

    running: bool
    pid: int | None = None
    host: str | None = None
    started: float | None = None  # unix time
    heartbeat_age_s: float | None = None
    hung: bool = False

    def describe(self) -> str:
        if not self.running:
            return "not running"
        age = f"{self.heartbeat_age_s:.0f} s ago" if self.heartbeat_age_s is not None else "never"
        return f"pid {self.pid}, last heartbeat {age}" + (" (hung)" if self.hung else "")


def agent_status(cache_dir: str | os.PathLike[str]) -> AgentStatus:
    directory = Path(cache_dir)
    if not lock_held(directory):
        return AgentStatus(running=False)
    status = directory / STATUS_NAME
    try:
        info = json.loads(status.read_text())
        age = max(0.0, time.time() - status.stat().st_mtime)
    except (OSError, ValueError):
        return AgentStatus(running=True)  # between taking the lock and writing its status
    pid = info.get("pid") if isinstance(info.get("pid"), int) else None
    hung = age > HUNG_S and pid is not None and state(pid) not in ("R", None)
    return AgentStatus(True, pid, info.get("host"), info.get("started"), age, hung)


def lock_held(cache_dir: str | os.PathLike[str]) -> bool:
    """Whether an agent holds the lock now. Probes by taking it for an instant: an agent starting at that
    very moment waits for it (``AgentLock.acquire``), so the probe never keeps one out."""
    path = Path(cache_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases it if we took it
    return False


class AgentLock:
    """The flock that makes an agent the only one on its cache directory, and its heartbeat."""

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self.directory = Path(cache_dir)
        self._fd: int | None = None

    def acquire(self, *, wait_s: float = 10.0) -> bool:
        """Take the lock, waiting up to ``wait_s`` for a previous holder that is exiting, and replacing a
        hung one. False: another agent runs."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                status = agent_status(self.directory)
                if status.hung and status.pid is not None:
                    log.warning("node agent pid %d is hung (%s): replacing it", status.pid, status.describe())
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(status.pid, signal.SIGKILL)
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(0.1)
        self._fd = fd
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        tmp = self.directory / f".{STATUS_NAME}.{os.getpid()}"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.directory / STATUS_NAME)
        return True

    def heartbeat(self) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.directory / STATUS_NAME)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.directory / STATUS_NAME)
        os.close(self._fd)  # the lock goes with the descriptor
        self._fd = None


def lower_priority(*, whole_process: bool = False) -> None:
    """SCHED_IDLE (the CPU only when nothing else wants it) and the idle I/O class (the disk only when
    nothing else uses it) for the calling thread, or for every thread of the process (``whole_process``: a
    process of its own), and for every thread started from them later. Best effort."""
    threads = [int(t) for t in os.listdir("/proc/self/task")] if whole_process else [0]
    number = _SYS_IOPRIO_SET.get(platform.machine())
    libc = ctypes.CDLL(None, use_errno=True) if number is not None else None
    for tid in threads:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError) as exc:
            log.info("cannot use SCHED_IDLE (%s): nice 19 instead", exc)
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, 19)
        if libc is not None and number is not None:
            prio = _IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT
            if libc.syscall(number, _IOPRIO_WHO_PROCESS, tid, prio) != 0:
                log.info("cannot use the idle I/O class: %s", os.strerror(ctypes.get_errno()))


# -- engines on the node -------------------------------------------------------------------------------


def register_engine(cache_dir: str | os.PathLike[str]) -> Path:
    """Mark this process as an engine using the cache (removed by `unregister_engine`, or found dead)."""
    folder = Path(cache_dir) / ENGINES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / str(os.getpid())
    marker.touch()
    return marker


def unregister_engine(marker: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        marker.unlink()


def live_engines(cache_dir: str | os.PathLike[str]) -> list[int]:
    """Pids of engine processes using the cache; markers of dead ones are removed."""
    live: list[int] = []
    folder = Path(cache_dir) / ENGINES_DIR
    with contextlib.suppress(FileNotFoundError):
        for marker in folder.iterdir():
            if not marker.name.isdigit():
                continue
            pid = int(marker.name)
            if alive(pid):
                live.append(pid)
            else:
                with contextlib.suppress(FileNotFoundError):
                    marker.unlink()
    return live


# -- starting and stopping -----------------------------------------------------------------------------


def spawn_agent(settings: Settings, *, exit_when_idle_s: float) -> subprocess.Popen[bytes]:
    """Start an agent for ``settings.cache_dir`` in a process of its own, in a new session (it outlives the
    engine that starts it). Returns at once; the agent reads its settings, secrets included, from a pipe,
    so none of them lands in a file, an argument list or the environment."""
    directory = Path(settings.cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "kvstore.agent", "--settings-from-stdin"]
    command += ["--exit-when-idle", repr(exit_when_idle_s)]
    with open(directory / LOG_NAME, "ab") as output:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=output,
            stderr=output,
            start_new_session=True,
            close_fds=True,
            cwd="/",
        )
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        _write_settings(settings, proc.stdin)
    # Reap it whenever it ends, so it never lingers as a zombie of the engine.
    threading.Thread(target=proc.wait, name="kvstore-agent-reaper", daemon=True).start()
    return proc


def stop_agent(cache_dir: str | os.PathLike[str], *, timeout_s: float = 10.0) -> bool:
    """Stop the agent of ``cache_dir`` (SIGTERM, then SIGKILL after ``timeout_s``); True once none runs.
    The signal goes to the process that runs the agent, which may host other things (`kvstore serve`)."""
    status = agent_status(cache_dir)
    if not status.running:
        return True
    if status.pid is None:
        return False
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(status.pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not lock_held(cache_dir):
                return True
            time.sleep(0.05)
    return not lock_held(cache_dir)


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
        return str(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, BaseModel):  # a store spec
        return {
            k: _plain(getattr(value, k)) for k in type(value).model_fields if getattr(value, k) is not None
        }
    if isinstance(value, enum.Enum):
        return value.name.lower()  # the codec, by name
    return value


class AgentWatch:
    """An engine's view of its node's agent: whether one runs (checked every ``every_s``, from the engine's
    housekeeping thread), said once in the log when that changes; and, when the engine may start one
    (``start``), a new agent at most every ``restart_every_s`` while none runs."""

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        *,
        start: Callable[[], object] | None = None,
        every_s: float = 5.0,
        restart_every_s: float = 30.0,
    ) -> None:
        self._directory = Path(cache_dir)
        self._start = start
        self._every = every_s
        self._restart_every = restart_every_s
        self._checked_at = float("-inf")
        self._started_at = float("-inf")
        self.up: bool | None = None  # unknown until the first check

    @property
    def starting(self) -> bool:
        """This engine started an agent moments ago that may not listen yet."""
        return time.monotonic() - self._started_at < self._restart_every

    def check(self) -> bool:
        now = time.monotonic()
        if now - self._checked_at < self._every and self.up is not None:
            return self.up
        self._checked_at = now
        up = lock_held(self._directory)
        if up != self.up:
            if up:
                log.info("node agent runs for %s", self._directory)
            else:
                log.warning(
                    "no node agent runs for %s: uploads wait in the journal, object hits are not admitted "
                    "to NVMe%s",
                    self._directory,
                    "; starting one" if self._start is not None else " (start `kvstore agent`)",
                )
            self.up = up
        if not up and self._start is not None and now - self._started_at >= self._restart_every:
            self._started_at = now
            try:
                self._start()
            except (OSError, ValueError) as exc:
                log.warning("could not start a node agent: %s", exc)
        return up
