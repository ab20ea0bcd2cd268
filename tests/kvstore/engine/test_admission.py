"""Admission of object hits to NVMe: held while the engine's foreground is busy, written once it is quiet or
at the latest after ``max_delay_s``; what does not fit the budget is not held."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.engine.admission import Admission
from kvstore.engine.io import Fetched
from tests.helpers import wait_for

SIZE = 1000


class Foreground:
    """What the admission asks about: busy until told otherwise, the pieces of work begun (with
    ``loads_between_looks``, one more each time it is asked); and the batches it wrote."""

    def __init__(self) -> None:
        self.busy = True
        self.started = 0
        self.loads_between_looks = False
        self.written: list[list[str]] = []

    def begun(self) -> int:
        if self.loads_between_looks:
            self.started += 1
        return self.started

    def write(self, batch: list[Fetched]) -> None:
        self.written.append([hit.key for hit in batch])

    def keys_written(self) -> list[str]:
        return [key for batch in self.written for key in batch]


@contextmanager
def admitting(foreground: Foreground, *, budget_chunks: int, max_delay_s: float = 60) -> Iterator[Admission]:
    """An admission writing to ``foreground``, its thread running until the block ends (which writes what
    is still queued)."""
    admission = Admission(
        foreground.write,
        lambda: foreground.busy,
        foreground.begun,
        budget_bytes=budget_chunks * SIZE,
        quiet_s=0.05,
        max_delay_s=max_delay_s,
    )
    thread = threading.Thread(target=admission.run, daemon=True)
    thread.start()
    try:
        yield admission
    finally:
        admission.close()
        thread.join(5)


def hit(key: str) -> Fetched:
    return Fetched(key, b"x" * SIZE)


def test_hits_wait_while_the_foreground_is_busy_and_go_once_it_is_quiet() -> None:
    foreground = Foreground()
    with admitting(foreground, budget_chunks=10) as admission:
        admission.offer([hit("a"), hit("b")])
        time.sleep(0.3)  # six times the quiet the write waits for
        assert foreground.written == []
        assert admission.held("a") is not None  # a repeat load copies it from here meanwhile
        foreground.busy = False
        wait_for(lambda: foreground.written == [["a", "b"]], what="the write once the foreground is quiet")
        assert admission.held("a") is None


def test_loads_that_begin_and_end_between_two_looks_keep_it_from_being_quiet() -> None:
    foreground = Foreground()
    foreground.busy = False  # never busy when looked at: each load is over within milliseconds
    foreground.loads_between_looks = True  # however late the looks come on a loaded machine
    with admitting(foreground, budget_chunks=10) as admission:
        admission.offer([hit("a")])
        time.sleep(0.3)  # six times the quiet the write waits for
        assert foreground.written == []
        foreground.loads_between_looks = False
        wait_for(lambda: foreground.written == [["a"]], what="the write once nothing begins any more")


def test_a_foreground_that_stays_busy_delays_the_write_by_max_delay_s_at_most() -> None:
    foreground = Foreground()
    with admitting(foreground, budget_chunks=10, max_delay_s=0.5) as admission:
        admission.offer([hit("a")])
        wait_for(lambda: foreground.written == [["a"]], timeout=5, what="the write after max_delay_s")
        assert foreground.busy


def test_what_does_not_fit_the_budget_is_not_held() -> None:
    foreground = Foreground()
    with admitting(foreground, budget_chunks=2) as admission:
        admission.offer([hit("a"), hit("b"), hit("c")])
        assert admission.held("b") is not None and admission.held("c") is None  # its next hit asks the bucket
    assert foreground.keys_written() == ["a", "b"]  # closing wrote what was queued, at once
