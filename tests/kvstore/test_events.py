"""KV events: what `KVEventPublisher` sends is what vLLM's own decoder reads, with our tier's values.
(`tests/connector/test_router_events.py` runs them past a real router.)"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from kvstore.errors import ConfigError
from kvstore.events import KVEventPublisher, open_publisher
from kvstore.keys import KVCacheGroup, Namespace, make_offload_key

kv_events = pytest.importorskip("vllm.distributed.kv_events")

NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def chunk_key(i: int, group: int = 0) -> str:
    return NS.chunk_key(make_offload_key(block_hash(i), group))


def test_vllm_decodes_block_removed_batches(kv_subscriber: Any) -> None:
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    with KVEventPublisher(kv_subscriber.endpoint) as publisher:
        publisher.publish_removed([chunk_key(1), chunk_key(2), chunk_key(3, group=1), "_meta/gc/lease.json"])
        publisher.publish_removed([chunk_key(4)])
        topic, seq, batch = kv_subscriber.next()
        assert (topic, seq) == (b"", 0)
        assert isinstance(batch, kv_events.KVEventBatch) and batch.data_parallel_rank == 0
        by_group = {event.group_idx: event for event in batch.events}
        assert set(by_group) == {0, 1}
        assert all(isinstance(event, kv_events.BlockRemoved) for event in batch.events)
        # The hashes as vLLM itself would publish them for these blocks.
        expected = [maybe_convert_block_hash(BlockHash(block_hash(i))) for i in (1, 2)]
        assert by_group[0].block_hashes == expected
        assert by_group[1].block_hashes == [maybe_convert_block_hash(BlockHash(block_hash(3)))]
        event = by_group[0]
        # The tier's one residency: LOCAL like the tier, no ownership (routers drop events that carry one).
        assert (event.medium, event.locality, event.ownership) == (kv_events.MEDIUM_STORAGE, "LOCAL", None)
        _, seq, second = kv_subscriber.next()
        assert seq == 1 and second.events[0].block_hashes == [
            maybe_convert_block_hash(BlockHash(block_hash(4)))
        ]


def test_medium_locality_and_ownership_match_our_tier() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import _MEDIUM_TO_EVENT_STR
    from vllm.v1.kv_offload.base import Locality

    from kvstore import events
    from kvstore.connector import tier_events
    from kvstore.connector.tier import KVStoreTier

    # The tier reports a chunk as STORAGE, LOCAL by default, with no ownership: GC's removals end that.
    assert _MEDIUM_TO_EVENT_STR[KVStoreTier.medium] == events.MEDIUM_STORAGE
    assert Locality.LOCAL.value == events.LOCALITY_LOCAL and Locality.REMOTE.value == events.LOCALITY_REMOTE
    assert tuple(m.value for m in Locality) == events.LOCALITY_VALUES
    assert events.OWNERSHIP is None and tier_events.OWNERSHIP is None


def test_raw_hashes_when_vllm_sends_bytes(kv_subscriber: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    with KVEventPublisher(kv_subscriber.endpoint, topic="kv") as publisher:
        publisher.publish_removed([chunk_key(7)])
        topic, _, batch = kv_subscriber.next()
    assert topic == b"kv" and batch.events[0].block_hashes == [block_hash(7)]


def test_bind_endpoint_and_configuration(connect_kv_subscriber: Any) -> None:
    with KVEventPublisher("tcp://127.0.0.1:*") as publisher:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:") and not publisher.endpoint.endswith("*")
        subscriber = connect_kv_subscriber(publisher.endpoint)
        assert publisher.wait_for_subscriber(30)
        publisher.publish_removed([chunk_key(9)])
        assert subscriber.next()[2].events[0].group_idx == 0
    assert open_publisher("") is None
    with pytest.raises(ConfigError, match="events_endpoint"):
        KVEventPublisher("http://127.0.0.1:5557")
    with pytest.raises(ConfigError, match="events_endpoint"):
        KVEventPublisher("tcp://127.0.0.1:notaport")
    with pytest.raises(ConfigError, match="locality"):
        KVEventPublisher("tcp://127.0.0.1:*", locality="remote")
