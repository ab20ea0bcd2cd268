"""The tiered engine against a real S3 server and a real LMDB-indexed NVMe cache."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvstore.cache import NVMeCache
from kvstore.chunk import Codec
from kvstore.engine import Presence, TieredStore
from kvstore.errors import ConfigError
from kvstore.metrics import EngineMetrics
from kvstore.stores import MemoryStore, ObjectStore

CHUNK = 64 * 1024


def payload(i: int) -> bytes:
    values = np.random.default_rng(i).standard_normal(CHUNK // 2).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def keys(n: int, tag: str = "k") -> list[str]:
    return [f"ns_abc_r0/{tag}/{i:04d}.bin" for i in range(n)]


def sample(metrics: EngineMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def metrics() -> EngineMetrics:
    return EngineMetrics(CollectorRegistry())


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[NVMeCache]:
    with NVMeCache(tmp_path / "nvme", budget_bytes=64 * CHUNK + 64 * 1024) as c:
        yield c


def make_engine(
    store: ObjectStore | None, cache: NVMeCache | None, metrics: EngineMetrics, **kwargs: object
) -> TieredStore:
    return TieredStore(
        store,
        cache,
        metrics=metrics,
        outage_cooldown_s=kwargs.pop("cooldown", 1.0),  # type: ignore[arg-type]
        **kwargs,
    )  # type: ignore[arg-type]


def load(engine: TieredStore, names: Sequence[str]) -> list[bytes | None]:
    bufs = [memoryview(bytearray(CHUNK)) for _ in names]
    ok = engine.load_into(list(zip(names, bufs, strict=True)))
    return [bytes(b) if good else None for b, good in zip(bufs, ok, strict=True)]


@pytest.mark.parametrize("codec", list(Codec))
def test_store_then_load_from_nvme_and_object(
    s3_store: ObjectStore, cache: NVMeCache, metrics: EngineMetrics, tmp_path: Path, codec: Codec
) -> None:
    names = keys(8)
    engine = make_engine(s3_store, cache, metrics, codec=codec)
    outcome = engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
    assert outcome.written == 8 and outcome.queued == 8
    assert engine.flush(30)
    assert engine.lookup(names) == [Presence.LOCAL] * 8
    assert load(engine, names) == [payload(i) for i in range(8)]
    assert sample(metrics, "kvstore:read_bytes_total", tier="nvme") == 8 * CHUNK
    again = engine.store_many([(names[0], payload(0))])
    assert again.skipped == 1
    engine.close()

    # A fresh node sharing only the bucket: hits come from the object store, then from its own NVMe.
    with NVMeCache(tmp_path / "other", budget_bytes=64 * CHUNK) as fresh_cache:
        other = make_engine(s3_store, fresh_cache, metrics)
        assert other.lookup(names) == [Presence.REMOTE] * 8
        assert load(other, names) == [payload(i) for i in range(8)]
        deadline = time.monotonic() + 10
        while not all(fresh_cache.contains_many(names)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert other.lookup(names) == [Presence.LOCAL] * 8
        other.close()


def test_lookup_without_waiting_probes_in_background(s3_store: ObjectStore, metrics: EngineMetrics) -> None:
    names = keys(5)
    writer = make_engine(s3_store, None, metrics)
    writer.store_many([(k, payload(i)) for i, k in enumerate(names[:3])])
    assert writer.flush(30)
    writer.close()
    reader = make_engine(s3_store, None, metrics)
    first = reader.lookup(names, wait=False)
    assert set(first) <= {Presence.PENDING, Presence.REMOTE, Presence.MISS}
    deadline = time.monotonic() + 10
    answer = first
    while Presence.PENDING in answer and time.monotonic() < deadline:
        time.sleep(0.02)
        answer = reader.lookup(names, wait=False)
    assert answer == [Presence.REMOTE] * 3 + [Presence.MISS] * 2
    reader.mark_missing(names[0])
    assert reader.lookup(names[:1], wait=False) == [Presence.MISS]
    reader.close()


def wait_answers(engine: TieredStore, names: Sequence[str]) -> list[Presence]:
    engine.probe_async(names)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answers = [engine.lookup_cached(k) for k in names]
        if Presence.PENDING not in answers:
            return answers
        time.sleep(0.01)
    pytest.fail("probe never answered")


def fill(store: ObjectStore, metrics: EngineMetrics, names: Sequence[str]) -> None:
    writer = make_engine(store, None, metrics)
    writer.store_many([(k, payload(i)) for i, k in enumerate(names)])
    assert writer.flush(30)
    writer.close()


def test_probe_fetches_hits_so_the_load_needs_no_second_round(
    s3_store: ObjectStore, metrics: EngineMetrics
) -> None:
    names = keys(6, "prefetch")
    fill(s3_store, metrics, names[:4])
    engine = make_engine(s3_store, None, metrics)
    assert wait_answers(engine, names) == [Presence.REMOTE] * 4 + [Presence.MISS] * 2
    held = sample(metrics, "kvstore:prefetch_bytes")
    assert held == sum(len(s3_store.get(k) or b"") for k in names[:4])
    # The objects go away after the probe: the load is served from what the probe fetched, verified.
    s3_store.delete_many(names[:4])
    assert load(engine, names[:4]) == [payload(i) for i in range(4)]
    assert sample(metrics, "kvstore:read_bytes_total", tier="object") == 4 * len(payload(0))
    assert sample(metrics, "kvstore:prefetch_bytes") == 0
    # Each prefetched blob serves one load; the next one goes to the store (now a miss).
    assert load(engine, names[:1]) == [None]
    engine.close()


class SlowGets(MemoryStore):
    """An in-memory store whose GETs of keys under `slow/` wait until `gate` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.waiting = 0

    def get(self, key: str) -> bytes | None:
        if "/slow/" in key:
            self.waiting += 1
            self.gate.wait(30)
        return super().get(key)


def test_prefetched_chunks_load_while_the_io_workers_wait_on_the_network(metrics: EngineMetrics) -> None:
    store = SlowGets()
    ready, slow = keys(4, "ready"), keys(2, "slow")
    fill(store, metrics, ready + slow)
    engine = make_engine(store, None, metrics, io_workers=2)
    assert wait_answers(engine, ready) == [Presence.REMOTE] * 4
    engine.probe_async(slow)  # both io workers now wait on GETs that do not return
    deadline = time.monotonic() + 10
    while store.waiting < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    loaded: list[list[bytes | None]] = []
    loader = threading.Thread(target=lambda: loaded.append(load(engine, ready)))
    loader.start()
    loader.join(10)  # the held chunks need no io worker: this must not wait for the gate
    done_before_gate = not loader.is_alive()
    store.gate.set()
    loader.join(30)
    assert done_before_gate
    assert loaded == [[payload(i) for i in range(4)]]
    engine.close()


def test_object_hits_reach_nvme_when_the_engine_closes_right_after_the_load(
    s3_store: ObjectStore, metrics: EngineMetrics, tmp_path: Path
) -> None:
    names = keys(4, "admit-at-close")
    fill(s3_store, metrics, names)
    with NVMeCache(tmp_path / "fresh", budget_bytes=64 * CHUNK) as fresh:
        engine = make_engine(s3_store, fresh, metrics)
        assert load(engine, names) == [payload(i) for i in range(4)]
        engine.close()  # admission waits for a quiet moment, but what is queued is written at close
        assert fresh.contains_many(names) == [True] * 4


def test_prefix_probe_asks_first_keys_first_and_stops_a_chain_at_its_miss(
    s3_store: ObjectStore, metrics: EngineMetrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = keys(5, "chain-a"), keys(3, "chain-b")
    fill(s3_store, metrics, first[:2] + second)  # the first request's prefix ends after two chunks
    asked: list[str] = []
    real_get = s3_store.get

    def recording_get(key: str) -> bytes | None:
        asked.append(key)
        return real_get(key)

    monkeypatch.setattr(s3_store, "get", recording_get)
    engine = make_engine(s3_store, None, metrics, io_workers=1)
    engine.probe_prefixes([first, second])
    deadline = time.monotonic() + 10
    while engine.lookup_cached(second[-1]) is Presence.PENDING and time.monotonic() < deadline:
        time.sleep(0.01)
    # Rank by rank over the requests, and nothing past the first request's miss.
    assert asked == [first[0], second[0], first[1], second[1], first[2], second[2]]
    assert [engine.lookup_cached(k) for k in first] == [Presence.REMOTE] * 2 + [Presence.MISS] + [
        Presence.PENDING
    ] * 2
    assert [engine.lookup_cached(k) for k in second] == [Presence.REMOTE] * 3
    engine.close()


def test_corrupt_prefetched_chunk_is_never_served(s3_store: ObjectStore, metrics: EngineMetrics) -> None:
    names = keys(1, "prefetch-corrupt")
    fill(s3_store, metrics, names)
    blob = bytearray(s3_store.get(names[0]) or b"")
    blob[-5] ^= 0x10
    s3_store.put(names[0], bytes(blob))
    engine = make_engine(s3_store, None, metrics)
    assert wait_answers(engine, names) == [Presence.REMOTE]
    assert load(engine, names) == [None]
    assert sample(metrics, "kvstore:checksum_failures_total", tier="object") == 1
    assert s3_store.get(names[0]) is None  # the bad object is removed
    assert engine.lookup_cached(names[0]) is Presence.MISS
    engine.close()


def test_probe_by_head_when_prefetch_is_off(s3_store: ObjectStore, metrics: EngineMetrics) -> None:
    names = keys(2, "prefetch-off")
    fill(s3_store, metrics, names)
    engine = make_engine(s3_store, None, metrics, prefetch_bytes=0)
    assert wait_answers(engine, names) == [Presence.REMOTE] * 2
    s3_store.delete_many(names)
    assert load(engine, names) == [None, None]  # nothing was held: the load asked the store
    engine.close()


def test_corrupt_nvme_copy_is_never_served(
    s3_store: ObjectStore, cache: NVMeCache, metrics: EngineMetrics
) -> None:
    names = keys(2, "corrupt-nvme")
    engine = make_engine(s3_store, cache, metrics)
    engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
    assert engine.flush(30)
    located = cache.locate(names[0])
    assert located is not None
    with open(located.path, "r+b") as f:
        f.seek(located.size - 10)
        byte = f.read(1)
        f.seek(located.size - 10)
        f.write(bytes([byte[0] ^ 0x40]))
    # The bad NVMe copy is dropped and counted; the good object copy serves the read.
    assert load(engine, names[:1]) == [payload(0)]
    assert sample(metrics, "kvstore:checksum_failures_total", tier="nvme") == 1
    assert cache.locate(names[0]) is None or cache.get(names[0]) is not None
    engine.close()


def test_corrupt_object_is_a_miss_and_removed(s3_store: ObjectStore, metrics: EngineMetrics) -> None:
    names = keys(1, "corrupt-obj")
    engine = make_engine(s3_store, None, metrics)
    engine.store_many([(names[0], payload(0))])
    assert engine.flush(30)
    blob = bytearray(s3_store.get(names[0]) or b"")
    blob[-3] ^= 0x01
    s3_store.put(names[0], bytes(blob))
    assert load(engine, names) == [None]
    assert sample(metrics, "kvstore:checksum_failures_total", tier="object") == 1
    assert s3_store.get(names[0]) is None
    assert engine.lookup(names) == [Presence.MISS]
    engine.close()


def test_store_outage_degrades_to_nvme_and_recovers(
    private_s3_server: Any, private_s3_store: ObjectStore, cache: NVMeCache, metrics: EngineMetrics
) -> None:
    server, store = private_s3_server, private_s3_store
    engine = make_engine(store, cache, metrics, cooldown=0.5)
    before = keys(3, "before")
    engine.store_many([(k, payload(i)) for i, k in enumerate(before)])
    assert engine.flush(30)

    server.stop()
    during = keys(3, "during")
    engine.store_many([(k, payload(10 + i)) for i, k in enumerate(during)])
    engine.flush(60)
    assert (
        sample(metrics, "kvstore:stores_dropped_total", reason="store_down")
        + sample(metrics, "kvstore:stores_dropped_total", reason="error")
        >= 1
    )
    # Reads keep working from NVMe while the store is gone.
    assert load(engine, before + during) == [payload(i) for i in range(3)] + [
        payload(10 + i) for i in range(3)
    ]
    assert sample(metrics, "kvstore:object_store_up") == 0

    server.start()
    time.sleep(0.6)
    after = keys(3, "after")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        engine.store_many([(k, payload(20 + i)) for i, k in enumerate(after)])
        engine.flush(30)
        if all(store.exists_many(after)):
            break
        time.sleep(0.5)
    assert all(store.exists_many(after)), "uploads resume once the store is back"
    engine.close()


class GatedStore(MemoryStore):
    """A real in-memory store whose writes wait on a gate: stands in for a store that has become slow."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.gate.wait(30)
        super().put(key, data)


def test_slow_store_drops_instead_of_queueing_without_bound(metrics: EngineMetrics) -> None:
    store = GatedStore()
    engine = make_engine(store, None, metrics, upload_queue_bytes=4 * (CHUNK + 64), upload_workers=1)
    names = keys(12, "slow")
    outcome = engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
    assert outcome.dropped >= 6 and outcome.queued + outcome.dropped == 12
    assert engine.upload_queue_bytes <= 4 * (CHUNK + 64)
    assert sample(metrics, "kvstore:stores_dropped_total", reason="queue_full") == outcome.dropped
    # Chunks waiting for upload are already servable.
    queued = [k for k in names if engine.lookup([k]) == [Presence.LOCAL]]
    assert len(queued) == outcome.queued
    store.gate.set()
    assert engine.flush(30)
    report = engine.close()
    assert report.not_uploaded == []
    assert all(store.exists_many(queued))


def test_close_reports_chunks_never_uploaded(metrics: EngineMetrics) -> None:
    store = GatedStore()
    engine = make_engine(store, None, metrics, upload_workers=1)
    names = keys(5, "shutdown")
    engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
    report = engine.close(flush=True, timeout=0.2)
    store.gate.set()
    assert 1 <= len(report.not_uploaded) <= 5
    assert set(report.not_uploaded) <= set(names)


def test_engine_needs_a_tier() -> None:
    with pytest.raises(ConfigError):
        TieredStore(None, None)
