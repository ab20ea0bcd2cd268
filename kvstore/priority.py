"""Idle CPU and I/O priority for background work: the node agent, the embedded S3 server's maintenance.

Work nobody waits on takes only what the engines leave: SCHED_IDLE runs a thread only when no other wants
the CPU, and the idle I/O class uses the disk only when nothing else does. Both are inherited by threads
and processes started later (across exec too), so a child set up with `lower_child_priority` in its
`preexec_fn` runs its whole life at idle priority.

A `preexec_fn` makes `subprocess` fork the caller. In a large process (vLLM's engine, a benchmark holding
hundreds of MiB of buffers) a fork copies the page tables with the GIL held, and every page the caller
writes afterwards faults once: 512 faults per 2 MiB buffer refilled, doubling the CPU of a GET into it. For
commands started while the caller works, `background_command` instead starts a small interpreter that sets
the same up for itself and execs the command, so the caller is never forked.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import signal
import sys
from collections.abc import Sequence

__all__ = [
    "background_child",
    "background_command",
    "die_with_parent",
    "lower_child_priority",
    "lower_priority",
]

log = logging.getLogger(__name__)

_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_IDLE = 3
_IOPRIO_CLASS_SHIFT = 13
_SYS_IOPRIO_SET_BY_MACHINE = {"x86_64": 251, "aarch64": 30}
_SYS_IOPRIO_SET = _SYS_IOPRIO_SET_BY_MACHINE.get(platform.machine())
# Loaded here, not in a child between fork and exec (the loader's lock may be held by a thread gone there).
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def lower_priority(*, whole_process: bool = False) -> None:
    """SCHED_IDLE (the CPU only when nothing else wants it) and the idle I/O class (the disk only when
    nothing else uses it) for the calling thread, or for every thread of the process (``whole_process``: a
    process of its own), and for every thread started from them later. Best effort."""
    threads = [int(t) for t in os.listdir("/proc/self/task")] if whole_process else [0]
    for tid in threads:
        for failure in _lower(tid):
            log.info("%s", failure)


def lower_child_priority() -> None:
    """`lower_priority` for a `preexec_fn`: the child between fork and exec, one thread, which must not
    log (a lock another thread held at the fork is never released there)."""
    _lower(0)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child before exec: on Linux, ``sig`` when the thread that started it ends (with its process, or
    before), so a killed starter never leaves the child behind. Elsewhere a no-op."""
    if _LIBC is not None:
        with contextlib.suppress(OSError, AttributeError):
            _LIBC.prctl(_PR_SET_PDEATHSIG, sig)


def background_child() -> None:
    """`die_with_parent` and `lower_child_priority`: a child that takes only the CPU and disk time the engines
    leave and ends with its starter."""
    die_with_parent()
    lower_child_priority()


# Run by the interpreter `background_command` starts: it is the starter's child, so what it sets up before the
# exec holds for the command (PR_SET_PDEATHSIG survives exec; the priorities are inherited). A starter that
# died before that is no longer its parent: then the command never runs.
_BACKGROUND_EXEC = (
    "import os, sys\nfrom kvstore.priority import background_child\nbackground_child()\n"
    "if os.getppid() != int(sys.argv[1]):\n    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def background_command(argv: Sequence[str]) -> list[str]:
    """``argv`` (its program an absolute path) as a `background_child`, started without forking the caller:
    give it to `subprocess.Popen` with no `preexec_fn` (which then spawns with vfork). It dies with the
    caller's thread that started it (`die_with_parent`) once it runs: keep that thread waiting on it."""
    return [sys.executable, "-I", "-c", _BACKGROUND_EXEC, str(os.getpid()), *argv]


def _lower(tid: int) -> list[str]:
    """Idle CPU and I/O priority for thread ``tid`` (0: the caller); what could not be done."""
    failures = []
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError) as exc:
        failures.append(f"cannot use SCHED_IDLE ({exc}): nice 19 instead")
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)
    if _LIBC is not None and _SYS_IOPRIO_SET is not None:
        prio = _IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT
        if _LIBC.syscall(_SYS_IOPRIO_SET, _IOPRIO_WHO_PROCESS, tid, prio) != 0:
            failures.append(f"cannot use the idle I/O class: {os.strerror(ctypes.get_errno())}")
    return failures
