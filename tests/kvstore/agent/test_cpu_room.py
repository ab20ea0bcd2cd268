"""`CpuRoom`: idle CPU time over a window, from /proc/stat, counting only the CPUs this process may use."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvstore.agent.cpu_room import CpuRoom

# user nice system idle iowait irq softirq steal guest guest_nice
_BEFORE = """cpu  900 0 100 1000 0 0 0 0 0 0
cpu0 100 0 0 500 0 0 0 0 0 0
cpu1 100 0 0 500 0 0 0 0 0 0
cpu2 700 0 100 0 0 0 0 0 0 0
intr 12345
"""
# Over the window: cpu0 idle 30 + iowait 10 of 100 ticks, cpu1 busy throughout (guest time is already in its
# user time, so its 100 ticks are not 200), cpu2 (not ours) idle throughout.
_AFTER = """cpu  1100 0 100 1230 10 0 0 0 0 0
cpu0 160 0 0 530 10 0 0 0 0 0
cpu1 200 0 0 500 0 0 0 0 100 0
cpu2 700 0 100 200 0 0 0 0 0 0
intr 12399
"""


def _idle_over_window(tmp_path: Path, cpus: set[int]) -> float | None:
    stat = tmp_path / "stat"
    stat.write_text(_BEFORE)
    # The counters move while the room looks: the second read finds the later ones.
    threading.Timer(0.05, stat.write_text, (_AFTER,)).start()
    return CpuRoom(stat_path=stat, cpus=cpus).idle_cores(0.3, threading.Event())


def test_idle_time_counts_idle_and_iowait_of_the_allowed_cpus_only(tmp_path: Path) -> None:
    assert _idle_over_window(tmp_path, {0, 1}) == pytest.approx(2 * 40 / 200)


def test_a_machine_of_one_cpu_needs_half_of_it_idle() -> None:
    assert CpuRoom(cpus={0}).needed_cores == 0.5
    assert CpuRoom(cpus={0, 1, 2, 3}).needed_cores == 1.0


def test_without_proc_stat_nothing_is_known_and_there_is_room(tmp_path: Path) -> None:
    room = CpuRoom(stat_path=tmp_path / "absent", cpus={0, 1})
    assert room.idle_cores(0.01, threading.Event()) is None
    assert room.has_room(0.01, threading.Event())


_SPIN = "import time\nend = time.monotonic() + 20\nwhile time.monotonic() < end: pass\n"


def test_cpus_kept_busy_leave_no_room() -> None:
    """On the real /proc/stat: with a spinning process per allowed CPU, less than a core is idle."""
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in os.sched_getaffinity(0)]
    try:
        room = CpuRoom()
        idle = room.idle_cores(0.5, threading.Event())
        assert idle is not None and idle < room.needed_cores
        assert not room.has_room(0.5, threading.Event())
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def test_a_stop_ends_the_look_at_once() -> None:
    stopping = threading.Event()
    stopping.set()
    assert CpuRoom().idle_cores(30.0, stopping) is None
