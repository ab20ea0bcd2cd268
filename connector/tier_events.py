"""The tier's KV events: each copy of a chunk (NVMe, bucket) is a residency of its own in vLLM's events.

vLLM's `OffloadingEventsTracker` keys a chunk's residencies on (medium, ownership) and keeps its metadata
until the last one is removed. Both our copies are `Medium.STORAGE`, so the ownership tells them apart:
`KVStoreTier/nvme` for this node's NVMe copy, `KVStoreTier/object` for the bucket's. With one ownership for
both, the `BlockRemoved` of an NVMe eviction would end the residency of a block that is still in the bucket,
and routers would forget it. GC's `BlockRemoved` (`kvstore.events`) uses the bucket copy's ownership.

Each copy reports its own locality, set by the tier's options like vLLM's tiers set theirs: `locality` for the
NVMe copy (and the tier itself, which vLLM's per-request tier filters read), default LOCAL; `object_locality`
for the bucket copy, default REMOTE (any instance reaches it). A value that is not LOCAL or REMOTE, the empty
string included, is refused at start-up, as `Locality(value)` in vLLM's own tiers refuses it.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from kvstore.engine import ChunkEvent
from kvstore.errors import ConfigError
from kvstore.events import OWNERSHIP_NVME, OWNERSHIP_OBJECT
from kvstore.keys import chunk_key_to_offload_key

__all__ = ["OWNERSHIP_NVME", "OWNERSHIP_OBJECT", "parse_locality", "to_vllm_events"]

_OWNERSHIP = {"nvme": OWNERSHIP_NVME, "object": OWNERSHIP_OBJECT}


def parse_locality(option: str, value: object, default: Locality) -> Locality:
    """A `locality` option as vLLM reads it; `ConfigError` naming the option for anything else."""
    if value is None:
        return default
    try:
        return Locality(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in Locality)
        raise ConfigError(f"KVStoreTier: {option} must be one of {choices}, got {value!r}") from None


def to_vllm_events(
    events: Iterable[ChunkEvent], *, prefix: str, localities: dict[str, Locality]
) -> list[OffloadingEvent]:
    """vLLM events for the engine's chunk events under `prefix` (the NVMe cache is shared with other
    namespaces): one per (copy, stored or removed), in first-seen order."""
    grouped: dict[tuple[str, bool], list[OffloadKey]] = {}
    for event in events:
        if event.key.startswith(prefix):
            grouped.setdefault((event.tier, event.removed), []).append(
                OffloadKey(chunk_key_to_offload_key(event.key))
            )
    return [
        OffloadingEvent(
            keys=keys,
            medium=Medium.STORAGE,
            removed=removed,
            locality=localities[tier],
            ownership=_OWNERSHIP[tier],
            removal_expected=not removed,  # NVMe evicts and GC deletes: keep metadata for BlockRemoved
        )
        for (tier, removed), keys in grouped.items()
    ]
