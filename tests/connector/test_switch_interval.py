"""The GIL switch interval follows the scheduler's rhythm: short while requests wait on the tier, except
inside a scheduling pass that follows a model step."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from kvstore.connector.switch_interval import SwitchInterval

FAST = 0.00002


@pytest.fixture(autouse=True)
def normal_interval() -> Iterator[float]:
    normal = sys.getswitchinterval()
    yield normal
    sys.setswitchinterval(normal)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_short_only_while_a_request_waits(normal_interval: float) -> None:
    switch = SwitchInterval(FAST, clock=Clock())
    switch.pass_ended(waiting=False)
    assert sys.getswitchinterval() == pytest.approx(normal_interval)
    switch.wait_started()
    assert sys.getswitchinterval() == pytest.approx(FAST)
    switch.pass_ended(waiting=True)
    assert sys.getswitchinterval() == pytest.approx(FAST)
    switch.pass_started(waiting=False)  # the load finished
    assert sys.getswitchinterval() == pytest.approx(normal_interval)


def test_a_pass_after_a_model_step_keeps_the_normal_interval(normal_interval: float) -> None:
    clock = Clock()
    switch = SwitchInterval(FAST, model_step_s=0.001, clock=clock)
    switch.pass_ended(waiting=True)
    clock.now += 0.020  # the model ran: our threads had the GIL meanwhile
    switch.pass_started(waiting=True)
    assert sys.getswitchinterval() == pytest.approx(normal_interval)
    switch.pass_ended(waiting=True)
    assert sys.getswitchinterval() == pytest.approx(FAST)


def test_a_spinning_engine_loop_keeps_the_short_interval(normal_interval: float) -> None:
    clock = Clock()
    switch = SwitchInterval(FAST, model_step_s=0.001, clock=clock)
    switch.pass_ended(waiting=True)
    clock.now += 0.0001  # back at once: nothing ran, the loop holds the GIL between passes
    switch.pass_started(waiting=True)
    assert sys.getswitchinterval() == pytest.approx(FAST)
    switch.restore()
    assert sys.getswitchinterval() == pytest.approx(normal_interval)


def test_zero_leaves_the_interval_alone(normal_interval: float) -> None:
    switch = SwitchInterval(0.0, clock=Clock())
    switch.wait_started()
    switch.pass_ended(waiting=True)
    assert sys.getswitchinterval() == pytest.approx(normal_interval)
    assert not switch.short
