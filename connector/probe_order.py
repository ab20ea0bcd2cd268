"""The order in which the tier probes one scheduler step's unknown chunks.

vLLM looks chunks up one by one; the tier batches a step's unknown chunks into chains so the engine can stop a
chain at its first miss (`TieredStore.probe_prefixes`) instead of asking the store about keys vLLM cannot use,
and, where the operator asks for it (`probe_tail_tokens`), asks only this node about a request's short tail.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple


class UnknownChunk(NamedTuple):
    """A chunk the scheduler looked up that the tier must probe."""

    req_id: str
    group: bytes  # the KV-cache group, the last bytes of vLLM's offload key
    position: int | None  # end token of the chunk in its request, as vLLM records it
    key: str


class ProbePlan(NamedTuple):
    chains: list[list[str]]  # asked of this node, then of the bucket
    node_only: list[list[str]]  # short tails after a beginning the node holds: asked of this node only


def prefix_chains(
    lookups: Sequence[UnknownChunk], *, chunk_tokens: int = 0, tail_tokens: int = 0
) -> ProbePlan:
    """The probe order for one step's unknown chunks (see `TieredStore.probe_prefixes`).

    vLLM scans a full-attention group from the first chunk on and can use only the chunks before the first
    miss: such a run (positions ascending) becomes one chain. A sliding-window group is scanned from the end
    and can use a suffix after a miss, so a run in any other order is probed key by key, every key counting.

    A chain that starts after the request's first chunk (vLLM or the tier held what comes before it) and
    spans at most ``tail_tokens`` is the request's short tail (a conversation's new turn): asked of this node
    only when ``tail_tokens`` > 0. ``chunk_tokens``: the most tokens a chunk holds in any KV-cache group.
    """
    runs: dict[tuple[str, bytes], list[UnknownChunk]] = {}
    for chunk in lookups:
        runs.setdefault((chunk.req_id, chunk.group), []).append(chunk)
    plan = ProbePlan([], [])
    for run in runs.values():
        positions = [c.position for c in run]
        ascending = all(a is not None and b is not None and a < b for a, b in itertools.pairwise(positions))
        if not ascending:
            plan.chains.extend([c.key] for c in run)
            continue
        first, last = positions[0], positions[-1]
        short_tail = (
            tail_tokens > 0
            and first is not None
            and last is not None
            and first > chunk_tokens
            and last - first + chunk_tokens <= tail_tokens
        )
        (plan.node_only if short_tail else plan.chains).append([c.key for c in run])
    return plan
