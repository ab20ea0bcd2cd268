"""Whether the node's CPUs have room for background work: idle CPU time over a short window, from /proc/stat.

Uploads cost the node CPU: the agent's reads and PUTs, and an embedded SeaweedFS's work for each PUT (it
MD5s every byte four times). At idle priority they still run whenever an engine's thread blocks or yields,
and vLLM's threads yield in a loop while they wait for each other, so a yielded core goes to the uploads
until the scheduler takes it back. Measured on 2 cores: uploads during a burst of multi-turn requests cost
it a quarter of its throughput, the same uploads after it nothing. So the agent first asks whether the
engines leave a core idle.

Only the CPUs this process may run on count (a cpuset, a pinned container). A CPU quota (cgroup ``cpu.max``)
is not seen: a throttled container's CPUs look idle.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_STAT = Path("/proc/stat")


class CpuRoom:
    def __init__(self, *, stat_path: Path = _STAT, cpus: set[int] | None = None) -> None:
        """``cpus``: the CPUs that count (default: those this process may run on)."""
        self._stat_path = stat_path
        self._cpus = cpus if cpus is not None else _allowed_cpus()
        # A core's worth of idle time, or half the CPUs on a machine with fewer than two.
        self.needed_cores = min(1.0, len(self._cpus) / 2)

    def idle_cores(self, window_s: float, stopping: threading.Event) -> float | None:
        """The CPUs' idle time over the next ``window_s`` seconds, in cores (2.0: two CPUs idle throughout);
        None where /proc/stat cannot be read (then nothing is known and nothing should wait), or when
        ``stopping`` was set meanwhile."""
        before = self._idle_and_total()
        if before is None or stopping.wait(window_s):
            return None
        after = self._idle_and_total()
        if after is None:
            return None
        idle, total = after[0] - before[0], after[1] - before[1]
        if total <= 0:
            return float(len(self._cpus))  # no tick elapsed: nothing ran that the counters saw
        return len(self._cpus) * idle / total

    def has_room(self, window_s: float, stopping: threading.Event) -> bool:
        """Whether `needed_cores` were idle over the next ``window_s`` seconds (True when unknown)."""
        idle = self.idle_cores(window_s, stopping)
        return idle is None or idle >= self.needed_cores

    def _idle_and_total(self) -> tuple[int, int] | None:
        """Idle (idle + iowait) and total ticks of the counted CPUs since boot."""
        try:
            text = self._stat_path.read_text()
        except OSError:
            return None
        idle = total = 0
        for line in text.splitlines():
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in self._cpus:
                continue
            ticks = [int(field) for field in rest.split()[:8]]  # guest time is already in user time
            idle += ticks[3] + ticks[4]
            total += sum(ticks)
        return (idle, total) if total else None


def _allowed_cpus() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))
