"""The CPU time of this process's threads, by role."""

from __future__ import annotations

import threading
import time

from kvstore.connector.bench.thread_cpu import cpu_by_role, thread_cpu


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_pools_threads_count_as_one_role() -> None:
    spun = threading.Barrier(3)
    done = threading.Event()

    def work() -> None:
        _spin(0.1)
        spun.wait()
        done.wait()  # alive at the second snapshot: a thread that ended takes its CPU with it

    before = thread_cpu()
    pool = [threading.Thread(target=work, name=f"spinner_{i}") for i in range(2)]
    for thread in pool:
        thread.start()
    _spin(0.05)
    spun.wait()
    spent = cpu_by_role(before, thread_cpu())
    done.set()
    for thread in pool:
        thread.join()
    assert 0.15 <= spent["spinner"] <= 0.35  # two threads' 0.1 s each, in clock ticks
    assert not any(role.startswith("spinner_") for role in spent)
    assert spent["MainThread"] >= 0.03
