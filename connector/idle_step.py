"""Whether the vLLM scheduler step now ending scheduled nothing: the engine idles, waiting on tiers.

While a request waits on the tier (its lookups answered RETRY) and nothing else runs, vLLM's engine loop
steps about once a millisecond: each step looks up every chunk of the waiting request again, runs an empty
model step and sleeps 1 ms. On a new node's 47-chunk request that was 90 steps, half the engine process's CPU
while its GETs ran on the same cores. On such an idle step, while its probe or jobs are out, the tier waits a
little (`KVStoreTier.on_schedule_end`, ended early by a finished job or the probe's answers): nothing runs
that the wait could delay.

vLLM does not tell a tier whether the step scheduled anything. The connector's scheduler side is handed the
step's `SchedulerOutput` (`KVConnectorBase_V1.build_connector_meta(scheduler_output)`) just before it calls
the tiers' `on_schedule_end`, so it is read from that call's frame, a few frames up. Where it cannot be found
(another vLLM, another caller), the step counts as busy: the tier never waits on a guess.
"""

from __future__ import annotations

import sys
from types import FrameType

__all__ = ["step_scheduled_nothing"]

# Frames between the tier's `on_schedule_end` and vLLM's `build_connector_meta(scheduler_output)`: the
# tiering manager's `on_schedule_end` (vLLM 0.33), with room for a connector wrapping another.
_MAX_DEPTH = 6


def step_scheduled_nothing(depth: int = 2) -> bool:
    """True only when a caller's frame, from ``depth`` up (2: the caller of the function that calls this),
    holds the step's ``scheduler_output`` and it scheduled no token; False when it scheduled some or none
    was found."""
    frame: FrameType | None
    try:
        frame = sys._getframe(depth)
    except ValueError:
        return False
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return False
        if "scheduler_output" in frame.f_code.co_varnames:  # cheap; f_locals builds a dict
            output = frame.f_locals.get("scheduler_output")
            if output is not None:
                tokens = getattr(output, "total_num_scheduled_tokens", None)
                return isinstance(tokens, int) and tokens == 0
        frame = frame.f_back
    return False
