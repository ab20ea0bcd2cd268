"""Facts about this machine's processes, from the kernel: whether a pid is alive, its scheduler state, when it
started, which process holds an flock. Wherever a file or a lease names a process (the cache's writer
markers, the node agent's status, GC's lease), these decide whether that process is still the one named;
`signal_process` signals one only if it still is."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from pathlib import Path

__all__ = ["alive", "flock_holders", "signal_process", "start_time", "state"]


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


@functools.cache
def pid_namespace() -> str | None:
    """This process's PID namespace as /proc names it ("pid:[4026531836]"), None if unreadable: a pid means
    a process only in the namespace it was taken in."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def start_time(pid: int) -> str | None:
    """When the process started (clock ticks since boot, as /proc says it), "zombie" for one that died and
    waits to be reaped, None if unreadable: with the pid, it tells a reused pid from the process named."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return "zombie" if fields[0] in ("Z", "X") else fields[19]


def flock_holders(path: str | os.PathLike[str]) -> list[int]:
    """Pids that hold an flock on the file or directory at ``path`` (by device and inode), as the kernel's
    ``/proc/locks`` says: not a file's word, which anyone who can write it could forge. Empty if none, or if
    the kernel does not say (no /proc, a holder in another pid namespace)."""
    try:
        found = os.stat(path)
        table = Path("/proc/locks").read_text()
    except OSError:
        return []
    wanted = (os.major(found.st_dev), os.minor(found.st_dev), found.st_ino)
    holders: list[int] = []
    for line in table.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 6533 fe:00:2147642 0 EOF"; a waiter's line has "->" after the number.
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        with contextlib.suppress(ValueError):
            major, minor, inode = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == wanted and int(fields[4]) > 0:
                holders.append(int(fields[4]))
    return holders


def signal_process(pid: int, started: str, sig: signal.Signals) -> bool:
    """Send ``sig`` to ``pid`` only if it is the process that started at ``started`` (`start_time`): through a
    pidfd, so a pid reused after the check is never signalled. False if it is gone or not that process."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if start_time(pid) != started:
            return False  # the pid names another process now
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)
