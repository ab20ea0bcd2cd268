"""The order in which the tier probes one scheduler step's unknown chunks.

vLLM looks chunks up one by one; the tier batches a step's unknown chunks into chains so the engine can stop a
chain at its first miss (`TieredStore.probe_prefixes`) instead of asking the store about keys vLLM cannot use.
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


def prefix_chains(lookups: Sequence[UnknownChunk]) -> list[list[str]]:
    """The probe order for one step's unknown chunks (see `TieredStore.probe_prefixes`).

    vLLM scans a full-attention group from the first chunk on and can use only the chunks before the first
    miss: such a run (positions ascending) becomes one chain. A sliding-window group is scanned from the end
    and can use a suffix after a miss, so a run in any other order is probed key by key, every key counting.
    """
    runs: dict[tuple[str, bytes], list[UnknownChunk]] = {}
    for chunk in lookups:
        runs.setdefault((chunk.req_id, chunk.group), []).append(chunk)
    chains: list[list[str]] = []
    for run in runs.values():
        positions = [c.position for c in run]
        ascending = all(a is not None and b is not None and a < b for a, b in itertools.pairwise(positions))
        if ascending:
            chains.append([c.key for c in run])
        else:
            chains.extend([c.key] for c in run)
    return chains
