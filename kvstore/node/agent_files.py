"""The node agent's lock and status file: who runs for a cache directory, whether it is hung, and how it is
signalled without ever hitting another process.

=============  ========================================================================================
the directory  flock'ed by the running agent for as long as it runs: the one agent per cache directory.
               The kernel releases it however the agent dies. A directory cannot be swapped from inside
               itself, as a lock file can (remove ``agent.lock``, create another, lock that: two agents)
``agent.lock`` flock'ed too, after the directory: what an agent of an older release locks, so the two
               never run side by side during an upgrade
``agent.json`` the running agent's pid, the start time of that process, the lock's device and inode, host,
               start (unix time) and store; its mtime is the agent's heartbeat (every ``HEARTBEAT_S``)
=============  ========================================================================================

Files are believed only as far as the kernel confirms them. Which process holds the lock is read from
``/proc/locks``; ``agent.json`` counts only when it names that very process (pid and start time) and that
very lock (device and inode). A status file of any other shape, or naming anyone else, is ignored: it gives no
heartbeat, so no one is judged hung by it. A signal goes through a pidfd to the process that holds the lock,
checked again just before (`signal_agent`).

An agent that holds the lock but has not beaten for ``HUNG_S`` while not runnable (stopped, deadlocked; not a
starved idle-priority process, which is runnable) is hung: whoever wants to start one kills it first.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.node.private import PRIVATE_FILE, private_dir, tighten
from kvstore.processes import flock_holders, signal_process, start_time, state

__all__ = [
    "HEARTBEAT_S",
    "HUNG_S",
    "LOCK_NAME",
    "LOG_NAME",
    "STATUS_NAME",
    "AgentLock",
    "AgentStatus",
    "agent_status",
    "lock_held",
    "signal_agent",
]

log = logging.getLogger(__name__)

LOCK_NAME = "agent.lock"
STATUS_NAME = "agent.json"
LOG_NAME = "agent.log"
HEARTBEAT_S = 1.0
# An idle-priority agent on a saturated node may not run for many seconds: only a long silence while it is
# not even runnable means it is stuck.
HUNG_S = 120.0


@dataclass(frozen=True)
class AgentStatus:
    """Whether an agent holds the node's lock, which process that is (as the kernel says), and what it last
    said about itself (only when its status file is provably its own)."""

    running: bool
    pid: int | None = None
    host: str | None = None
    started: float | None = None  # unix time
    heartbeat_age_s: float | None = None
    hung: bool = False
    store: str | None = None  # the object store it serves (`kvstore.node.engines.store_identity`)
    process_start: str | None = None  # the holder's start time (`kvstore.processes.start_time`)

    def describe(self) -> str:
        if not self.running:
            return "not running"
        if self.pid is None:
            return "running (which process holds the lock is unknown)"
        age = f"{self.heartbeat_age_s:.0f} s ago" if self.heartbeat_age_s is not None else "unknown"
        return f"pid {self.pid}, last heartbeat {age}" + (" (hung)" if self.hung else "")


def agent_status(cache_dir: str | os.PathLike[str]) -> AgentStatus:
    """Never raises for what it finds: any status file, any lock."""
    directory = Path(cache_dir)
    if not lock_held(directory):
        return AgentStatus(running=False)
    holder = _holder(directory)
    if holder is None:
        return AgentStatus(running=True)
    process_start = start_time(holder)
    found = _read_status(directory)
    if found is None or not _names(found[0], holder, process_start, directory):
        return AgentStatus(True, pid=holder, process_start=process_start)
    record, mtime = found
    age = max(0.0, time.time() - mtime)
    hung = age > HUNG_S and state(holder) not in ("R", None)
    return AgentStatus(
        True, holder, record["host"], record["started"], age, hung, record["store"], process_start
    )


def lock_held(cache_dir: str | os.PathLike[str]) -> bool:
    """Whether an agent holds the lock now (this release's, on the directory, or an older one's, on
    ``agent.lock``). Asks the kernel's lock table; probes by taking the lock for an instant only where there
    is none to ask (a probe could keep a starting agent out for that instant, and would show in the table
    as a holder)."""
    directory = Path(cache_dir)
    if not directory.is_dir():
        return False
    if os.path.exists("/proc/locks"):
        return bool(flock_holders(directory) or flock_holders(directory / LOCK_NAME))
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases it if we took it
    return False


def signal_agent(cache_dir: str | os.PathLike[str], status: AgentStatus, sig: signal.Signals) -> bool:
    """Send ``sig`` to the agent ``status`` found, only if that process still holds the lock and still is the
    process it was (pid and start time). False if it is not, or is gone."""
    if status.pid is None or status.process_start is None:
        return False
    if _holder(Path(cache_dir)) != status.pid:
        return False
    return signal_process(status.pid, status.process_start, sig)


def _holder(directory: Path) -> int | None:
    """The process that holds the agent lock, from the kernel's lock table (None if it does not say)."""
    holders = flock_holders(directory) or flock_holders(directory / LOCK_NAME)
    return holders[0] if len(holders) == 1 else None


def _lock_id(directory: Path) -> list[int] | None:
    try:
        found = os.stat(directory)
    except OSError:
        return None
    return [found.st_dev, found.st_ino]


def _names(record: dict[str, Any], pid: int, process_start: str | None, directory: Path) -> bool:
    return (
        record["pid"] == pid
        and process_start is not None
        and record["process_start"] == process_start
        and record["lock"] == _lock_id(directory)
    )


# What agent.json must hold, field by field; anything else is not a status file this release wrote.
_SHAPE: dict[str, tuple[type, ...]] = {
    "pid": (int,),
    "process_start": (str,),
    "lock": (list,),
    "host": (str,),
    "started": (int, float),
    "store": (str,),
}


def _read_status(directory: Path) -> tuple[dict[str, Any], float] | None:
    path = directory / STATUS_NAME
    try:
        with open(path, "rb") as f:
            mtime = os.fstat(f.fileno()).st_mtime
            record = json.loads(f.read(65536))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    for name, types in _SHAPE.items():
        value = record.get(name)
        if not isinstance(value, types) or isinstance(value, bool):
            return None
    if not all(isinstance(n, int) for n in record["lock"]):
        return None
    return record, mtime


class AgentLock:
    """The locks that make an agent the only one on its cache directory, its status file and heartbeat."""

    def __init__(self, cache_dir: str | os.PathLike[str], *, store: str = "") -> None:
        self.directory = Path(cache_dir)
        self._store = store
        self._fds: tuple[int, int] | None = None

    def acquire(self, *, wait_s: float = 10.0) -> bool:
        """Take the lock, waiting up to ``wait_s`` for a previous holder that is exiting, and replacing a
        hung one. False: another agent runs."""
        private_dir(self.directory)
        deadline = time.monotonic() + wait_s
        while (fds := self._try_lock()) is None:
            status = agent_status(self.directory)
            if status.hung:
                log.warning("node agent pid %s is hung (%s): replacing it", status.pid, status.describe())
                signal_agent(self.directory, status, signal.SIGKILL)
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        self._fds = fds
        self._write_status()
        return True

    def _try_lock(self) -> tuple[int, int] | None:
        # The directory first: a contender that cannot have it holds nothing, so the lock table only ever
        # names agents (and an older release's agent on agent.lock).
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            lock_fd = os.open(
                self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, PRIVATE_FILE
            )
        except BlockingIOError:
            os.close(dir_fd)
            return None
        except BaseException:
            os.close(dir_fd)
            raise
        tighten(self.directory / LOCK_NAME)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # an agent of an older release runs
            os.close(lock_fd)
            os.close(dir_fd)
            return None
        return dir_fd, lock_fd

    def _write_status(self) -> None:
        record = {
            "pid": os.getpid(),
            "process_start": start_time(os.getpid()),
            "lock": _lock_id(self.directory),
            "host": socket.gethostname(),
            "started": time.time(),
            "store": self._store,
        }
        tmp = self.directory / f".{STATUS_NAME}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.directory / STATUS_NAME)

    def heartbeat(self) -> None:
        try:
            os.utime(self.directory / STATUS_NAME)
        except FileNotFoundError:  # removed under us: said again, so the agent can be found and judged
            with contextlib.suppress(OSError):
                self._write_status()
        except OSError:
            pass

    def release(self) -> None:
        if self._fds is None:
            return
        found = _read_status(self.directory)
        if found is not None and found[0]["pid"] == os.getpid():
            with contextlib.suppress(OSError):
                os.unlink(self.directory / STATUS_NAME)
        for fd in reversed(self._fds):
            os.close(fd)  # the locks go with the descriptors
        self._fds = None
