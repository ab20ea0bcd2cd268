"""The GIL switch interval of vLLM's engine process while requests wait on the tier.

Our I/O threads share one GIL with vLLM's scheduler thread. Python makes a thread that wants the GIL wait up
to the switch interval (5 ms) before it may take it from a thread that never lets go, and vLLM's engine loop
never lets go while it spins with nothing to run but requests waiting on us: each of our threads coming back
from a read would queue for milliseconds, and a load of 50 chunks spend most of its time queueing. So while a
request waits on the tier (a load, or a probe after a RETRY) the interval is short.

A short interval also lets our threads preempt the scheduler's own pass every few microseconds. When the
engine runs model steps between passes, our threads get the GIL while the model runs, so the interval is
short only between passes; inside a pass the scheduler keeps Python's interval. A gap of at least
`model_step_s` between two passes tells the two rhythms apart: a spinning loop comes back within
microseconds, a model step takes milliseconds.

Scheduler thread only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


class SwitchInterval:
    def __init__(
        self,
        fast_s: float,
        *,
        model_step_s: float = 0.001,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._fast = fast_s  # 0: never change the interval
        self._model_step = model_step_s
        self._clock = clock
        self._normal = sys.getswitchinterval()
        self._short = False
        self._pass_ended: float | None = None

    @property
    def short(self) -> bool:
        return self._short

    def pass_started(self, *, waiting: bool) -> None:
        """The scheduler's first call into the tier in a pass. `waiting`: a request still waits on us."""
        ended = self._pass_ended
        after_model_step = ended is not None and self._clock() - ended >= self._model_step
        self._set(waiting and not after_model_step)

    def pass_ended(self, *, waiting: bool) -> None:
        """The scheduler's last call in a pass; the model runs next (or the loop spins)."""
        self._pass_ended = self._clock()
        self._set(waiting)

    def wait_started(self) -> None:
        """A request now waits on the tier (a load was submitted)."""
        self._set(True)

    def restore(self) -> None:
        self._set(False)

    def _set(self, short: bool) -> None:
        if self._fast and short != self._short:
            sys.setswitchinterval(self._fast if short else self._normal)
            self._short = short
