"""Idle CPU and I/O priority for background work, down to the children it starts."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from typing import Any

import pytest

from kvstore.priority import background_command, lower_child_priority

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

_CAPTURE: dict[str, Any] = {"capture_output": True, "text": True, "check": True, "timeout": 30}


def _assert_idle(done: subprocess.CompletedProcess[str]) -> None:
    """The child and its thread reported idle CPU and I/O priority; this process kept its own."""
    expected_io = str(_IOPRIO_CLASS_IDLE) if _IOPRIO_GET is not None else "-1"
    assert done.stdout.split("\n")[:2] == [f"{_SCHED_IDLE} {expected_io}"] * 2
    assert os.sched_getscheduler(0) != _SCHED_IDLE, "the starter keeps its priority"


@pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE and I/O classes are Linux's")
def test_a_child_started_with_lower_child_priority_runs_idle_and_so_do_its_threads() -> None:
    _assert_idle(subprocess.run([sys.executable, "-c", _REPORT], preexec_fn=lower_child_priority, **_CAPTURE))


@pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE and I/O classes are Linux's")
def test_a_background_command_runs_idle_without_forking_its_starter() -> None:
    """Its starter's at-fork handlers never run: subprocess forks the caller only for a `preexec_fn`."""
    forks: list[int] = []
    os.register_at_fork(before=lambda: forks.append(1))
    _assert_idle(subprocess.run(background_command([sys.executable, "-c", _REPORT]), **_CAPTURE))
    assert forks == [], "the starter was forked"


# A starter that runs a sleeper in the background, says its pid once it sleeps, and waits.
_STARTER = """
import os, subprocess, sys, time
from kvstore.priority import background_command
child = subprocess.Popen(background_command(["/bin/sleep", "600"]))
while open(f"/proc/{child.pid}/comm").read().strip() != "sleep":
    time.sleep(0.01)
print(child.pid, flush=True)
child.wait()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_background_command_ends_with_its_starter() -> None:
    starter = subprocess.Popen([sys.executable, "-c", _STARTER], stdout=subprocess.PIPE, text=True)
    try:
        assert starter.stdout is not None
        child = int(starter.stdout.readline())
        starter.kill()
        starter.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(child):
            assert time.monotonic() < deadline, "the background command outlived its starter"
            time.sleep(0.02)
    finally:
        starter.kill()
        starter.wait()


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for the reaper."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
