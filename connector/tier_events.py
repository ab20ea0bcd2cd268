"""The tier's KV events: one residency per chunk, "this instance's tier holds it", for the routers.

A prefix-aware router (Dynamo's KV indexer, llm-d's) credits an instance with a block from the engine's own
events: vLLM's `OffloadingEventsTracker` turns what a tier returns from `take_events` into `BlockStored` /
`BlockRemoved` on the engine's ZMQ publisher. What Dynamo 1.6 does with each (its standalone indexer, run in
`tests/connector/test_router_events.py`) fixes the shape of ours:

- an event with any `ownership` is dropped, whatever the string (ours, vLLM's own `kvcr`): the residency
  carries none (`OWNERSHIP`, None);
- an event with `locality` REMOTE is dropped ("no consumer for a shared index yet"): the residency reports
  the tier's own `locality` (LOCAL by default), bucket copy included: this instance loads it through the tier;
- a removal is not reference counted: one `BlockRemoved` of a STORAGE block ends the disk credit, whichever
  copy it was about. So the NVMe copy and the bucket copy are one residency, and it ends only with the last
  copy this node knows of: an NVMe eviction or discard of a chunk whose bucket copy exists says nothing; the
  engine marks the eviction of a chunk that never reached the bucket (`last_copy`), and its deletion of a
  corrupt bucket object, which it only reads when the node has no copy, ends the residency too. GC's
  deletions come from GC's own publisher (`kvstore.events`), on a feed a router registers for each instance;
- `BlockStored` must carry the block's tokens (vLLM's `self_describing_kv_events`, which the tracker fills in
  from what the scheduler saw); a chunk's later upload is not announced again: by then the tracker may have
  dropped its payload and would send a placeholder (`block_size` 0) that routers reject.

Stores are announced without `removal_expected`: the tracker then keeps a chunk's payload only as long as
the CPU tier holds the chunk, not for as long as the bucket does (forever, for this process). A later removal
without the payload names the chunk's offload key, the hash of its last block: exact when a chunk is one
block (vLLM's default), enough to end the prefix match at that block otherwise.

`locality` and `object_locality` are parsed like vLLM's tiers parse theirs: a value that is not LOCAL or
REMOTE, the empty string included, is refused at start-up. `object_locality` no longer changes the tier's
events (GC's publisher still uses it); `locality` is also what vLLM's per-request tier filters read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from kvstore.engine import ChunkEvent
from kvstore.errors import ConfigError
from kvstore.events import OWNERSHIP, OWNERSHIP_NVME, OWNERSHIP_OBJECT
from kvstore.keys import chunk_key_to_offload_key

__all__ = [
    "OWNERSHIP",
    "OWNERSHIP_NVME",
    "OWNERSHIP_OBJECT",
    "announce_served",
    "ends_residency",
    "parse_locality",
    "to_vllm_events",
]


def parse_locality(option: str, value: object, default: Locality) -> Locality:
    """A `locality` option as vLLM reads it; `ConfigError` naming the option for anything else."""
    if value is None:
        return default
    try:
        return Locality(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in Locality)
        raise ConfigError(f"KVStoreTier: {option} must be one of {choices}, got {value!r}") from None


def ends_residency(event: ChunkEvent) -> bool:
    """Whether a removal leaves this node without any copy of the chunk (see the module docstring)."""
    if event.tier == "object":
        return True
    # An eviction or discard of a chunk whose upload never finished (the change log says so).
    return event.last_copy


def to_vllm_events(
    events: Iterable[ChunkEvent],
    *,
    prefix: str,
    localities: dict[str, Locality],
) -> list[OffloadingEvent]:
    """vLLM events for the engine's chunk events under `prefix` (the NVMe cache is shared with other
    namespaces), in order, consecutive events of one kind in one `OffloadingEvent`.

    The residency starts with the chunk's NVMe copy (the tier always has an NVMe cache; an upload extends the
    residency and is not announced). `localities["nvme"]` is the tier's own locality, which it reports."""
    locality = localities["nvme"]
    runs: list[tuple[bool, dict[OffloadKey, None]]] = []  # (removed, keys in first-seen order)
    for event in events:
        if not event.key.startswith(prefix):
            continue
        if event.removed:
            if not ends_residency(event):
                continue
        elif event.tier == "object":
            continue
        key = OffloadKey(chunk_key_to_offload_key(event.key))
        if not runs or runs[-1][0] != event.removed:
            runs.append((event.removed, {}))
        runs[-1][1][key] = None
    return [_event(list(keys), removed=removed, locality=locality) for removed, keys in runs]


def announce_served(keys: Sequence[OffloadKey], *, locality: Locality) -> OffloadingEvent | None:
    """A `BlockStored` for chunks this tier served to a request, to be returned by `take_events` once the
    request has finished (by then vLLM's tracker has their payload from the request's lookups). It gives
    routers back the chunks this tier held before the engine (re)started, which nothing announced since."""
    return _event(list(dict.fromkeys(keys)), removed=False, locality=locality) if keys else None


def _event(keys: list[OffloadKey], *, removed: bool, locality: Locality) -> OffloadingEvent:
    return OffloadingEvent(
        keys=keys,
        medium=Medium.STORAGE,
        removed=removed,
        locality=locality,
        ownership=OWNERSHIP,
        removal_expected=False,  # see the module docstring: the CPU tier bounds how long vLLM keeps payloads
    )
