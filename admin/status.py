"""Answers about the object store that never wait on it: `/healthz` and `/v1/stats` must answer within two
seconds whatever the store does (frozen, partitioned, slow), so what needs the store is computed on a
background thread and the request reads the last result.

`Refreshed(compute)` runs `compute` when a reader finds its last result older than `max_age_s`; the reader
waits for that run at most until it has taken `wait_s`, then answers with what it has (the previous result
and the fact that a run is overdue). Only one run is in flight at a time, so a store that hangs ties up one
thread, not one per request; each run ends by itself through the store's own deadlines.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Refreshed", "Snapshot"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class Snapshot(Generic[_T]):
    """What a reader gets: the last completed run (its value or its error, and how old it is), and whether a
    newer run is still going past the reader's wait (`overdue_s`: how long it has been running)."""

    value: _T | None
    error: BaseException | None
    age_s: float | None  # since the last run completed; None if none has
    overdue_s: float | None  # a run in flight for longer than the reader waited; None if there is none

    @property
    def ok(self) -> bool:
        return self.age_s is not None and self.error is None and self.overdue_s is None


class Refreshed(Generic[_T]):
    def __init__(self, compute: Callable[[], _T], *, max_age_s: float, wait_s: float, name: str) -> None:
        self._compute = compute
        self._max_age_s = max_age_s
        self._wait_s = wait_s
        self._name = name
        self._cond = threading.Condition()
        self._value: _T | None = None
        self._error: BaseException | None = None
        self._done_at: float | None = None
        self._started_at: float | None = None  # of the run in flight

    def _run(self) -> None:
        value: _T | None = None
        error: BaseException | None = None
        try:
            value = self._compute()
        except Exception as exc:  # kept for the readers, who decide what it means
            error = exc
        with self._cond:
            self._value, self._error = value, error
            self._done_at = time.monotonic()
            self._started_at = None
            self._cond.notify_all()

    def get(self) -> Snapshot[_T]:
        with self._cond:
            now = time.monotonic()
            if self._done_at is None or now - self._done_at >= self._max_age_s:
                if self._started_at is None:
                    self._started_at = now
                    threading.Thread(target=self._run, name=f"kvstore-{self._name}", daemon=True).start()
                started = self._started_at
                self._cond.wait_for(
                    lambda: self._started_at is None, timeout=max(0.0, started + self._wait_s - now)
                )
            now = time.monotonic()
            overdue = None if self._started_at is None else now - self._started_at
            age = None if self._done_at is None else now - self._done_at
            return Snapshot(self._value, self._error, age, overdue)
