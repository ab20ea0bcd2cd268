"""Idle CPU and I/O priority for background work, down to the children it starts."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from kvstore.priority import lower_child_priority

_SCHED_IDLE = 5
_IOPRIO_CLASS_IDLE = 3
_IOPRIO_GET = {"x86_64": 252, "aarch64": 31}.get(platform.machine())

# The child reports its own scheduling policy and I/O class, and those of a thread it starts.
_REPORT = f"""
import ctypes, os, threading
libc = ctypes.CDLL(None, use_errno=True)
def report():
    io = libc.syscall({_IOPRIO_GET or -1}, 1, 0) >> 13 if {_IOPRIO_GET is not None} else -1
    print(os.sched_getscheduler(0), io)
report()
thread = threading.Thread(target=report)
thread.start()
thread.join()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE and I/O classes are Linux's")
def test_a_child_started_with_lower_child_priority_runs_idle_and_so_do_its_threads() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _REPORT],
        preexec_fn=lower_child_priority,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split("\n")
    expected_io = str(_IOPRIO_CLASS_IDLE) if _IOPRIO_GET is not None else "-1"
    assert out[:2] == [f"{_SCHED_IDLE} {expected_io}"] * 2
    assert os.sched_getscheduler(0) != _SCHED_IDLE, "the parent keeps its priority"
