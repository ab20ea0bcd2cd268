"""Where a request's time goes on its way through the tier: milestones with their wall and CPU time.

For benchmarks and diagnosis, off by default (the tier option ``timeline_path`` turns it on). The tier opens
an episode at a request's first lookup and closes it when the request finishes; the tier and the engine mark
milestones into the open episode (requests a benchmark sends one at a time attribute exactly; with several
at once, engine-side marks go to the newest). Each milestone keeps its first and last time, how often it
happened, and the process's CPU time at its first and last occurrence, so a report can say, per phase, how
long it took and how much CPU the whole process (vLLM's engine, our threads) spent in it.

Closed episodes are appended as JSON lines to the file; `read_timelines` reads them back.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Milestones, in the order a fresh node's object hit passes them.
LOOKUP = "lookup"  # the scheduler asked the tier about a chunk of the request
PROBE_SENT = "probe_sent"  # the step's unknown chunks went to the probe
PROBE_STARTED = "probe_started"  # the probe thread took them
INDEX_READ = "index_read"  # the node's index answered for them
GET_RETURNED = "get_returned"  # an object-store GET came back (verified, answer published)
LOOKUP_HIT = "lookup_hit"  # the tier answered HIT: vLLM reserves a CPU-tier row and will promote it
LOAD_SUBMITTED = "load_submitted"  # vLLM submitted a promotion (load) job
LOAD_STARTED = "load_started"  # a job thread began it
LOAD_DONE = "load_done"  # the rows are filled
LOAD_REPORTED = "load_reported"  # vLLM took the finished job
ADMITTED = "admitted"  # object hits written to this node's NVMe (after the load, at a quiet moment)
FINISHED = "finished"  # the request finished (its first token, for a max_tokens=1 request)
STEP = "step"  # a scheduler step ended while the request was open

MILESTONES = (
    LOOKUP,
    PROBE_SENT,
    PROBE_STARTED,
    INDEX_READ,
    GET_RETURNED,
    LOOKUP_HIT,
    LOAD_SUBMITTED,
    LOAD_STARTED,
    LOAD_DONE,
    LOAD_REPORTED,
    ADMITTED,
    FINISHED,
)


@dataclass
class Milestone:
    first_s: float  # time.monotonic()
    last_s: float
    first_cpu_s: float  # time.process_time() of the whole process
    last_cpu_s: float
    count: int = 1


@dataclass
class Episode:
    request: str
    milestones: dict[str, Milestone] = field(default_factory=dict)

    def mark(self, name: str, now: float, cpu: float, n: int) -> None:
        found = self.milestones.get(name)
        if found is None:
            self.milestones[name] = Milestone(now, now, cpu, cpu, n)
        else:
            found.last_s, found.last_cpu_s = now, cpu
            found.count += n


class Timeline:
    """Thread-safe; every call is a few dict operations under a lock."""

    def __init__(
        self,
        path: str | Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
    ) -> None:
        self.path = Path(path)
        self._clock = clock
        self._cpu = cpu_clock
        self._open: dict[str, Episode] = {}
        self._current: Episode | None = None
        self._lock = threading.Lock()

    def begin(self, request: str) -> None:
        """A lookup for ``request``: opens its episode the first time (and marks the lookup)."""
        now, cpu = self._clock(), self._cpu()
        with self._lock:
            episode = self._open.get(request)
            if episode is None:
                episode = self._open[request] = Episode(request)
                self._current = episode
            episode.mark(LOOKUP, now, cpu, 1)

    def mark(self, name: str, n: int = 1) -> None:
        """A milestone of the newest open episode (nothing when none is open)."""
        now, cpu = self._clock(), self._cpu()
        with self._lock:
            if self._current is not None:
                self._current.mark(name, now, cpu, n)

    def end(self, request: str) -> None:
        """The request finished: its episode is written out."""
        now, cpu = self._clock(), self._cpu()
        with self._lock:
            episode = self._open.pop(request, None)
            if episode is None:
                return
            episode.mark(FINISHED, now, cpu, 1)
            if self._current is episode:
                self._current = next(reversed(self._open.values()), None)
        with self.path.open("a") as out:
            out.write(json.dumps(asdict(episode)) + "\n")


def read_timelines(path: str | Path) -> list[Episode]:
    """The episodes a `Timeline` wrote, oldest first (none if the file does not exist)."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    episodes = []
    for line in lines:
        raw = json.loads(line)
        episodes.append(Episode(raw["request"], {k: Milestone(**v) for k, v in raw["milestones"].items()}))
    return episodes
