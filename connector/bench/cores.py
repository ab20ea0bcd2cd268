"""A local S3 server kept off the benchmark's cores: the closest a small machine comes to a bucket served
elsewhere.

A node's bucket is served by other machines. The embedded server, started beside a benchmark on a machine of
two cores, takes its CPU from the same cores as the client it serves, so a client that spends more CPU per
byte also slows its own server: `bench tiers`' object path then measures the machine's CPU, not how close
our loads come to the wire. With ``--server-core`` the server's threads run on the last core the benchmark
may use and the benchmark's own threads (ours and the raw baseline's alike, and the engines it starts) on
the others, for the block's duration; both are put back as they were afterwards. What stands for the network
between them (a `SlowLink` proxy) goes with the server: it is not the node's either.

Linux only (``os.sched_setaffinity`` on each thread id under ``/proc/<pid>/task``); a thread started in the
block inherits the core of the thread that started it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["CoresUnavailable", "server_apart"]

_PASSES = 3  # a thread not pinned yet may start another while the others are being pinned


class CoresUnavailable(Exception):
    """The cores cannot be split as asked (one core, no local server, no affinity on this system)."""


def server_apart(
    server_pid: int | None, companions: Sequence[int] = ()
) -> contextlib.AbstractContextManager[tuple[set[int], set[int]]]:
    """For the block: the server process ``server_pid`` (and the ``companions``, the processes between it
    and the benchmark) on the last core this process may use, this process on the others; yields (the
    server's cores, the benchmark's). `CoresUnavailable` before the block when it cannot be done."""
    if server_pid is None:
        raise CoresUnavailable("no local S3 server to move (an endpoint is configured)")
    if not hasattr(os, "sched_setaffinity") or not Path(f"/proc/{server_pid}/task").is_dir():
        raise CoresUnavailable("this system does not let a process choose its threads' cores")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise CoresUnavailable(f"this process may use {len(cpus)} core: the server needs one of its own")
    return _apart([server_pid, *companions], {cpus[-1]}, set(cpus[:-1]))


@contextlib.contextmanager
def _apart(
    apart: list[int], server_cpus: set[int], own_cpus: set[int]
) -> Iterator[tuple[set[int], set[int]]]:
    own_pid = os.getpid()
    was = {pid: os.sched_getaffinity(pid) for pid in apart}
    own_was = os.sched_getaffinity(0)
    try:
        for pid in apart:
            _pin(pid, server_cpus)
        _pin(own_pid, own_cpus)
        yield server_cpus, own_cpus
    finally:
        for pid, cpus in was.items():
            with contextlib.suppress(ProcessLookupError):  # the server may have stopped meanwhile
                _pin(pid, cpus)
        _pin(own_pid, own_was)


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` on ``cpus`` (ProcessLookupError if the process is gone)."""
    for _ in range(_PASSES):
        moved = 0
        for tid in _threads(pid):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                if os.sched_getaffinity(tid) != cpus:
                    os.sched_setaffinity(tid, cpus)
                    moved += 1
        if not moved:
            return


def _threads(pid: int) -> list[int]:
    try:
        return [int(name) for name in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
