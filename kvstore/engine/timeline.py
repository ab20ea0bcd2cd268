"""Where a request's time goes on its way through the tier: milestones with their wall and CPU time.

For benchmarks and diagnosis, off by default (the tier option ``timeline_path`` turns it on). The tier opens
an episode at a request's first lookup and closes it when the request finishes; the tier and the engine mark
milestones into the open episode (requests a benchmark sends one at a time attribute exactly; with several
at once, engine-side marks go to the newest). Each milestone keeps its first and last time, how often it
happened, and the process's CPU time at its first and last occurrence, so a report can say, per phase, how
long it took and how much CPU the whole process (vLLM's engine, our threads) spent in it.

Closed episodes are appended as JSON lines to the file; `read_timelines` reads them back, and
`episode_phases` turns one into the stretches of a request (from the call that sent it to its first token).
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
IDLE_WAIT = "idle_wait"  # ... having scheduled nothing, and waited for the tier (`idle_step_wait_s`)

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
        self._write([episode])

    def close(self) -> None:
        """The tier stops: episodes still open are written as they stand, without `FINISHED` (vLLM tells a
        tier that a request finished at its next step, which an engine that stops next never takes)."""
        with self._lock:
            episodes, self._open, self._current = list(self._open.values()), {}, None
        self._write(episodes)

    def _write(self, episodes: list[Episode]) -> None:
        if episodes:
            with self.path.open("a") as out:
                out.writelines(json.dumps(asdict(episode)) + "\n" for episode in episodes)


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


@dataclass
class Phase:
    """One stretch of a request: from a milestone to the next."""

    name: str
    start_ms: float  # from the moment the request was sent
    end_ms: float
    cpu_ms: float  # CPU time of the whole process serving it (vLLM and our threads) in the stretch


# The stretches of a new node's request, each from a milestone (its first or last time) to the next.
_PHASES: tuple[tuple[str, tuple[str, str] | None, tuple[str, str] | None], ...] = (
    ("scheduler's first lookups", None, (LOOKUP, "first")),
    ("index read", (LOOKUP, "first"), (INDEX_READ, "first")),
    ("first GET returned", (INDEX_READ, "first"), (GET_RETURNED, "first")),
    ("all GETs returned", (GET_RETURNED, "first"), (GET_RETURNED, "last")),
    ("last promotion reported", (GET_RETURNED, "last"), (LOAD_REPORTED, "last")),
    ("first token", (LOAD_REPORTED, "last"), None),
)


def episode_phases(episode: Episode, sent: float, answered: float) -> list[Phase]:
    """The phases of one request whose episode this is; ``sent`` and ``answered`` are when the request was
    sent and its first token came back, on the same clock (time.monotonic, system-wide). A milestone the
    episode lacks (no GET: all on NVMe) makes its phases start where the request did."""
    marks = episode.milestones
    finished = marks.get(FINISHED)
    cpu_end = finished.first_cpu_s if finished is not None else None

    def at(point: tuple[str, str] | None, *, end: bool) -> tuple[float, float | None]:
        if point is None:
            return (answered, cpu_end) if end else (sent, None)
        m = marks.get(point[0])
        if m is None:
            return (sent, None)
        return (m.first_s, m.first_cpu_s) if point[1] == "first" else (m.last_s, m.last_cpu_s)

    out: list[Phase] = []
    for name, start, end in _PHASES:
        t0, c0 = at(start, end=False)
        t1, c1 = at(end, end=True)
        cpu = (c1 - c0) * 1e3 if c0 is not None and c1 is not None else 0.0
        out.append(Phase(name, (t0 - sent) * 1e3, (t1 - sent) * 1e3, cpu))
    if cpu_end is not None and LOOKUP in marks:
        cpu_start = marks[LOOKUP].first_cpu_s
        out.append(
            Phase(
                "whole request (from the first lookup)",
                0.0,
                (answered - sent) * 1e3,
                (cpu_end - cpu_start) * 1e3,
            )
        )
    return out
