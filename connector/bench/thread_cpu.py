"""This process's CPU time by thread, summed by role: where a benchmark's CPU per chunk goes.

A Python thread counts under its name less a pool's number (``kvstore-io_3`` -> ``kvstore-io``), any other
thread under the kernel's name for it (obstore's runtime: ``tokio-rt-worker``). A thread that ends between two
snapshots takes its CPU with it, so pools must outlive the span measured. Linux only; elsewhere, empty.
"""

from __future__ import annotations

import os
import re
import threading
from collections import defaultdict
from pathlib import Path

__all__ = ["ThreadCPU", "cpu_by_role", "thread_cpu"]

ThreadCPU = dict[int, tuple[str, float]]  # thread id -> (role, CPU seconds so far)

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_POOL_NUMBER = re.compile(r"_\d+$")


def thread_cpu() -> ThreadCPU:
    """Every thread of this process now: its role and CPU seconds so far."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: ThreadCPU = {}
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return out
    for task in tasks.iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            seconds = _cpu_seconds(task)
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
        tid = int(task.name)
        out[tid] = (_POOL_NUMBER.sub("", names[tid]) if tid in names else comm, seconds)
    return out


def _cpu_seconds(task: Path) -> float:
    """A thread's CPU time: nanoseconds from schedstat where the kernel keeps it, else clock ticks (10 ms,
    too coarse for a short run's threads)."""
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except FileNotFoundError:
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def cpu_by_role(before: ThreadCPU, after: ThreadCPU) -> dict[str, float]:
    """CPU seconds each role spent between two snapshots (a thread born in between, from its start)."""
    spent: defaultdict[str, float] = defaultdict(float)
    for tid, (role, cpu) in after.items():
        earlier = before.get(tid)
        spent[role] += cpu - (earlier[1] if earlier is not None and earlier[0] == role else 0.0)
    return {role: seconds for role, seconds in spent.items() if seconds > 0}
