"""Facts about this machine's processes, from the kernel: whether a pid is alive, its scheduler state, when it
started. Wherever a file or a lease names a process (the cache's writer markers, the node agent's status,
GC's lease), these decide whether that process is still the one named."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["alive", "start_time", "state"]


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie included; someone else's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of `/proc/<pid>/stat` after "pid (comm) " (comm may hold spaces); None if unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def state(pid: int) -> str | None:
    """The one-letter state (R running or runnable, S sleeping, D disk wait, T stopped, Z zombie...), None
    if the process is gone or unreadable."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[0]


def start_time(pid: int) -> str | None:
    """When the process started (clock ticks since boot, as /proc says it), "zombie" for one that died and
    waits to be reaped, None if unreadable: with the pid, it tells a reused pid from the process named."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return "zombie" if fields[0] in ("Z", "X") else fields[19]
