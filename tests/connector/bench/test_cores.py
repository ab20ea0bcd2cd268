"""`server_apart`: a real server process's threads on a core of their own and this process's on the others,
both put back afterwards; a clear refusal where it cannot be done."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from kvstore.connector.bench.cores import CoresUnavailable, server_apart

_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cores = pytest.mark.skipif(len(_CPUS) < 2, reason="needs a process allowed on two cores")

# A stand-in server: a process of four threads that live until it is killed.
_SERVER = (
    "import threading, time\nfor _ in range(3): threading.Thread(target=time.sleep, args=(600,)).start()\n"
)


@contextlib.contextmanager
def _stand_in() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", _SERVER])
    try:
        deadline = time.monotonic() + 30
        while len(_threads(process.pid)) < 4:
            assert time.monotonic() < deadline, "the stand-in server did not start its threads"
            time.sleep(0.02)
        yield process
    finally:
        process.kill()
        process.wait(timeout=30)


@pytest.fixture
def server() -> Iterator[subprocess.Popen[bytes]]:
    with _stand_in() as process:
        yield process


@pytest.fixture
def link() -> Iterator[subprocess.Popen[bytes]]:
    """A stand-in for the link proxy between the benchmark and the server."""
    with _stand_in() as process:
        yield process


def _threads(pid: int) -> list[int]:
    return [int(name) for name in os.listdir(f"/proc/{pid}/task")]


def _cores(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(tid)) for tid in _threads(pid)}


@needs_two_cores
def test_the_server_gets_the_last_core_and_both_are_put_back(server: subprocess.Popen[bytes]) -> None:
    pid = server.pid
    server_before, own_before = _cores(pid), _cores(os.getpid())
    started: list[set[int]] = []
    with server_apart(pid) as (server_cpus, own_cpus):
        assert server_cpus == {_CPUS[-1]} and own_cpus == set(_CPUS[:-1])
        assert _cores(pid) == {frozenset(server_cpus)}
        assert _cores(os.getpid()) == {frozenset(own_cpus)}
        # A thread the benchmark starts in the block runs where its starter does.
        thread = threading.Thread(target=lambda: started.append(os.sched_getaffinity(0)))
        thread.start()
        thread.join()
    assert started == [own_cpus]
    assert _cores(pid) == server_before
    assert _cores(os.getpid()) == own_before


@needs_two_cores
def test_the_link_goes_with_the_server_and_is_put_back(
    server: subprocess.Popen[bytes], link: subprocess.Popen[bytes]
) -> None:
    link_before = _cores(link.pid)
    with server_apart(server.pid, [link.pid]) as (server_cpus, _):
        assert _cores(link.pid) == {frozenset(server_cpus)}
    assert _cores(link.pid) == link_before


@needs_two_cores
def test_this_process_is_put_back_when_the_server_stopped_in_the_block(
    server: subprocess.Popen[bytes],
) -> None:
    own_before = _cores(os.getpid())
    with server_apart(server.pid):
        server.kill()
        server.wait(timeout=30)
    assert _cores(os.getpid()) == own_before


def test_no_local_server_is_refused_before_the_block() -> None:
    with pytest.raises(CoresUnavailable, match="no local S3 server"):
        server_apart(None)
