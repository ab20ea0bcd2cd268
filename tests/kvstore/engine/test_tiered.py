"""The tiered engine against a real S3 server and a real LMDB-indexed NVMe cache."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvstore.cache import NVMeCache
from kvstore.chunk import HEADER_BLOCK, Codec, encode, encode_legacy
from kvstore.engine import EngineThreads, Presence, TieredStore
from kvstore.errors import ConfigError
from kvstore.metrics import EngineMetrics
from kvstore.stores import MemoryStore, ObjectStore
from tests.helpers import FakeClock, sample, wait_for

CHUNK = 64 * 1024


def payload(i: int) -> bytes:
    values = np.random.default_rng(i).standard_normal(CHUNK // 2).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def keys(n: int, tag: str = "k") -> list[str]:
    return [f"ns_abc_r0/{tag}/{i:04d}.bin" for i in range(n)]


@pytest.fixture
def metrics() -> EngineMetrics:
    return EngineMetrics(CollectorRegistry())


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[NVMeCache]:
    with NVMeCache(tmp_path / "nvme", budget_bytes=64 * (CHUNK + HEADER_BLOCK)) as c:
        yield c


def make_engine(
    store: ObjectStore | None,
    cache: NVMeCache | None,
    metrics: EngineMetrics,
    *,
    io_workers: int = 16,
    upload_workers: int = 4,
    cooldown: float = 1.0,
    **kwargs: Any,
) -> TieredStore:
    threads = EngineThreads(io_workers=io_workers, disk_workers=4, upload_workers=upload_workers)
    return TieredStore(store, cache, metrics=metrics, threads=threads, outage_cooldown_s=cooldown, **kwargs)


def load(engine: TieredStore, names: Sequence[str], size: int = CHUNK) -> list[bytes | None]:
    bufs = [memoryview(bytearray(size)) for _ in names]
    ok = engine.load_into(list(zip(names, bufs, strict=True)))
    return [bytes(b) if good else None for b, good in zip(bufs, ok, strict=True)]


def fill(store: ObjectStore, names: Sequence[str], first: int = 0) -> None:
    for i, name in enumerate(names):
        store.put(name, encode(name, payload(first + i)).to_bytes())


@pytest.mark.parametrize("codec", list(Codec))
def test_store_then_load_from_nvme_and_object(
    s3_store: ObjectStore, cache: NVMeCache, metrics: EngineMetrics, tmp_path: Path, codec: Codec
) -> None:
    names = keys(8)
    engine = make_engine(s3_store, cache, metrics, codec=codec)
    outcome = engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
    assert outcome.written == 8 and outcome.kept == 8
    assert engine.flush(30)
    assert all(s3_store.exists_many(names))
    assert engine.lookup(names) == [Presence.LOCAL] * 8
    assert load(engine, names) == [payload(i) for i in range(8)]
    assert sample(metrics, "kvstore:read_bytes_total", tier="nvme") == 8 * CHUNK
    assert sample(metrics, "kvstore:write_bytes_total", tier="nvme") > 0
    assert sample(metrics, "kvstore:write_seconds_count", tier="nvme") == 8  # one observation per chunk
    assert sample(metrics, "kvstore:write_seconds_count", tier="object") == 8
    assert sample(metrics, "kvstore:read_seconds_count", tier="nvme") == 8
    again = engine.store_many([(names[0], payload(0))])
    assert again.skipped == 1
    engine.close()

    # A fresh node sharing only the bucket: hits come from the object store, then from its own NVMe.
    with NVMeCache(tmp_path / "other", budget_bytes=64 * (CHUNK + HEADER_BLOCK)) as fresh_cache:
        other = make_engine(s3_store, fresh_cache, EngineMetrics(CollectorRegistry()))
        assert other.lookup(names) == [Presence.REMOTE] * 8
        assert load(other, names) == [payload(i) for i in range(8)]
        wait_for(lambda: all(fresh_cache.contains_many(names)), what="admission of object hits")
        assert other.lookup(names) == [Presence.LOCAL] * 8
        assert fresh_cache.backlog().chunks == 0, "object hits are not uploaded again"
        other.close()


def test_lookup_without_waiting_probes_in_background(s3_store: ObjectStore, metrics: EngineMetrics) -> None:
    names = keys(5)
    writer = make_engine(s3_store, None, metrics)  # no NVMe: stores PUT before they return
    assert writer.store_many([(k, payload(i)) for i, k in enumerate(names[:3])]).uploaded == 3
    writer.close()
    reader = make_engine(s3_store, None, metrics)
    first = reader.lookup(names, wait=False)
    assert set(first) <= {Presence.PENDING, Presence.REMOTE, Presence.MISS}
    answer = first
    deadline = time.monotonic() + 10
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


def test_probe_fetches_hits_so_the_load_needs_no_second_round(
    s3_store: ObjectStore, metrics: EngineMetrics
) -> None:
    names = keys(6, "prefetch")
    fill(s3_store, names[:4])
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
    fill(store, ready + slow)
    engine = make_engine(store, None, metrics, io_workers=2)
    assert wait_answers(engine, ready) == [Presence.REMOTE] * 4
    engine.probe_async(slow)  # both io workers now wait on GETs that do not return
    wait_for(lambda: store.waiting >= 2, what="both io workers blocked")
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


def test_a_frozen_store_costs_a_load_its_deadline_once_then_the_breaker_answers(
    metrics: EngineMetrics,
) -> None:
    store = SlowGets()
    names = keys(3, "slow")
    fill(store, names)
    engine = make_engine(store, None, metrics, prefetch_bytes=0, load_timeout_s=0.5, cooldown=30)
    start = time.monotonic()
    assert load(engine, names) == [None] * 3
    first = time.monotonic() - start
    assert sample(metrics, "kvstore:object_store_up") == 0
    assert sample(metrics, "kvstore:object_store_errors_total", op="get") >= 1
    start = time.monotonic()
    assert load(engine, names) == [None] * 3  # the breaker is open: nobody waits on the store
    second = time.monotonic() - start
    store.gate.set()
    engine.close()
    assert first < 10, f"a load waited {first:.1f} s on a store that does not answer"
    assert second < first
    assert store.waiting == 3, "no GET was sent while the breaker was open"


def test_object_hits_reach_nvme_when_the_engine_closes_right_after_the_load(
    s3_store: ObjectStore, metrics: EngineMetrics, tmp_path: Path
) -> None:
    names = keys(4, "admit-at-close")
    fill(s3_store, names)
    with NVMeCache(tmp_path / "fresh", budget_bytes=64 * (CHUNK + HEADER_BLOCK)) as fresh:
        engine = make_engine(s3_store, fresh, metrics)
        assert load(engine, names) == [payload(i) for i in range(4)]
        engine.close()  # admission waits for a quiet moment, but what is queued is written at close
        assert fresh.contains_many(names) == [True] * 4


def test_prefix_probe_asks_first_keys_first_and_stops_a_chain_at_its_miss(
    s3_store: ObjectStore, metrics: EngineMetrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = keys(5, "chain-a"), keys(3, "chain-b")
    fill(s3_store, first[:2] + second)  # the first request's prefix ends after two chunks
    asked: list[str] = []
    real_get = s3_store.get_chunk

    def recording_get(key: str) -> object:
        asked.append(key)
        return real_get(key)

    monkeypatch.setattr(s3_store, "get_chunk", recording_get)
    engine = make_engine(s3_store, None, metrics, io_workers=1)
    engine.probe_prefixes([first, second])
    wait_for(lambda: engine.lookup_cached(second[-1]) is not Presence.PENDING, what="the probe")
    # Rank by rank over the requests, and nothing past the first request's miss.
    assert asked == [first[0], second[0], first[1], second[1], first[2], second[2]]
    assert [engine.lookup_cached(k) for k in first] == [Presence.REMOTE] * 2 + [Presence.MISS] + [
        Presence.PENDING
    ] * 2
    assert [engine.lookup_cached(k) for k in second] == [Presence.REMOTE] * 3
    engine.close()


def test_a_pending_key_is_probed_once_until_answered_or_asked_long_ago(metrics: EngineMetrics) -> None:
    now = [0.0]
    engine = make_engine(MemoryStore(), None, metrics, clock=lambda: now[0])
    key = keys(1, "dedupe")[0]
    assert engine.needs_probe(key)
    engine.probe_prefixes([[key]])
    assert not engine.needs_probe(key)
    now[0] = 2.0  # the injected clock decides when it is asked again
    assert engine.needs_probe(key)
    engine.close()


@pytest.mark.parametrize("prefetch", [0, 256 << 20], ids=["head", "get"])
def test_probe_answers_expire_after_their_ttls(metrics: EngineMetrics, prefetch: int) -> None:
    """ "Missing" is trusted for `probe_miss_ttl_s` (another node may upload the chunk any moment), "in the
    object store" for `probe_hit_ttl_s` (only GC takes chunks away); then the key is probed again."""
    clock = FakeClock()
    store = MemoryStore()
    engine = make_engine(
        store,
        None,
        metrics,
        clock=clock,
        probe_miss_ttl_s=2.0,
        probe_hit_ttl_s=600.0,
        prefetch_bytes=prefetch,
    )
    [name] = keys(1, f"ttl-{prefetch}")
    assert wait_answers(engine, [name]) == [Presence.MISS]
    fill(store, [name])  # another node uploads it
    clock.advance(1.9)
    assert engine.lookup_cached(name) is Presence.MISS, "a fresh miss answer is trusted"
    clock.advance(0.2)
    assert engine.lookup_cached(name) is Presence.PENDING, "an expired miss answer is asked again"
    assert wait_answers(engine, [name]) == [Presence.REMOTE]
    assert load(engine, [name]) == [payload(0)]
    store.delete(name)  # GC takes it
    clock.advance(599)
    assert engine.lookup_cached(name) is Presence.REMOTE, "a fresh hit answer is trusted"
    clock.advance(2)
    assert engine.lookup_cached(name) is Presence.PENDING, "an expired hit answer is asked again"
    assert wait_answers(engine, [name]) == [Presence.MISS]
    engine.close()


def test_corrupt_prefetched_chunk_is_never_served(s3_store: ObjectStore, metrics: EngineMetrics) -> None:
    names = keys(1, "prefetch-corrupt")
    fill(s3_store, names)
    blob = bytearray(s3_store.get(names[0]) or b"")
    blob[HEADER_BLOCK + 5] ^= 0x10
    s3_store.put(names[0], bytes(blob))
    engine = make_engine(s3_store, None, metrics)
    assert wait_answers(engine, names) == [Presence.MISS]  # verified as it arrived
    assert load(engine, names) == [None]
    assert sample(metrics, "kvstore:checksum_failures_total", tier="object") == 1
    assert s3_store.get(names[0]) is None  # proven corrupt, in a format this reader knows: removed
    engine.close()


def test_probe_by_head_when_prefetch_is_off(s3_store: ObjectStore, metrics: EngineMetrics) -> None:
    names = keys(2, "prefetch-off")
    fill(s3_store, names)
    engine = make_engine(s3_store, None, metrics, prefetch_bytes=0)
    assert wait_answers(engine, names) == [Presence.REMOTE] * 2
    s3_store.delete_many(names)
    assert load(engine, names) == [None, None]  # nothing was held: the load asked the store
    engine.close()


def test_corrupt_nvme_copy_is_discarded_and_the_object_serves(
    s3_store: ObjectStore, cache: NVMeCache, metrics: EngineMetrics
) -> None:
    names = keys(2, "corrupt-nvme")
    engine = make_engine(s3_store, cache, metrics)
    engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
    assert engine.flush(30)
    located = cache.locate(names[0])
    assert located is not None
    with open(located.path, "r+b") as f:
        f.seek(HEADER_BLOCK + 10)
        byte = f.read(1)
        f.seek(HEADER_BLOCK + 10)
        f.write(bytes([byte[0] ^ 0x40]))
    assert load(engine, names[:1]) == [payload(0)]
    assert sample(metrics, "kvstore:checksum_failures_total", tier="nvme") == 1
    assert not os.path.exists(located.path), "the bad copy is removed, not left for the next read"
    wait_for(lambda: cache.contains(names[0]), what="the good copy re-admitted")
    again = cache.locate(names[0])
    assert again is not None and again.path != located.path
    assert cache.get(names[0]) == payload(0)
    engine.close()


def test_corrupt_object_is_a_miss_and_removed(s3_store: ObjectStore, metrics: EngineMetrics) -> None:
    names = keys(1, "corrupt-obj")
    fill(s3_store, names)
    blob = bytearray(s3_store.get(names[0]) or b"")
    blob[HEADER_BLOCK + 3] ^= 0x01
    s3_store.put(names[0], bytes(blob))
    engine = make_engine(s3_store, None, metrics, prefetch_bytes=0)
    assert load(engine, names) == [None]
    assert sample(metrics, "kvstore:checksum_failures_total", tier="object") == 1
    assert s3_store.get(names[0]) is None
    assert engine.lookup(names) == [Presence.MISS]
    engine.close()


# -- a valid chunk under another key's name is a miss on every read path, and never copied anywhere


def _swap_nvme(cache: NVMeCache, victim: str, donor: str, how: str) -> None:
    src, dst = cache.locate(donor), cache.locate(victim)
    assert src is not None and dst is not None
    if how == "copy":
        shutil.copyfile(src.path, dst.path)
    else:  # rename: the donor's file takes the victim's name
        os.replace(src.path, dst.path)


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("how", ["copy", "rename"])
def test_a_chunk_swapped_on_nvme_is_never_served(
    tmp_path: Path, metrics: EngineMetrics, codec: Codec, how: str
) -> None:
    names = keys(2, "swap-nvme")
    with NVMeCache(tmp_path / "nvme", budget_bytes=10**8) as cache:
        engine = make_engine(None, cache, metrics, codec=codec)  # NVMe only: nothing can mask a bad read
        engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
        _swap_nvme(cache, names[1], names[0], how)
        assert load(engine, names[1:]) == [None]
        assert engine.get(names[1]) is None
        assert not cache.contains(names[1]), "the swapped copy is discarded"
        assert sample(metrics, "kvstore:checksum_failures_total", tier="nvme") == 1
        engine.close()


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("path", ["probe", "load", "get", "warm"])
def test_a_chunk_swapped_in_the_bucket_is_never_served_nor_cached(
    s3_store: ObjectStore, tmp_path: Path, metrics: EngineMetrics, codec: Codec, path: str
) -> None:
    names = keys(2, f"swap-obj-{path}-{codec.name}")
    s3_store.put(names[0], encode(names[0], payload(0), codec).to_bytes())
    s3_store.put(names[1], encode(names[0], payload(0), codec).to_bytes())  # names[0]'s chunk, copied
    with NVMeCache(tmp_path / "nvme", budget_bytes=10**8) as cache:
        engine = make_engine(s3_store, cache, metrics, prefetch_bytes=256 << 20 if path == "probe" else 0)
        victim = names[1]
        if path == "probe":
            assert wait_answers(engine, [victim]) == [Presence.MISS]
            assert load(engine, [victim]) == [None]
        elif path == "load":
            assert load(engine, [victim]) == [None]
        elif path == "get":
            assert engine.get(victim) is None
        else:
            assert engine.warm([victim]) == 0
        engine.close()
        assert not cache.contains(victim), "never copied into NVMe"
        assert s3_store.get(victim) is None, "a chunk provably not this key's is removed from its name"
        assert s3_store.get(names[0]) is not None, "the genuine chunk is untouched"


# -- a reader never deletes what it does not understand


def test_a_reader_with_another_buffer_size_deletes_nothing(
    s3_store: ObjectStore, tmp_path: Path, metrics: EngineMetrics
) -> None:
    names = keys(2, "buffer-size")
    with NVMeCache(tmp_path / "nvme", budget_bytes=10**8) as cache:
        writer = make_engine(s3_store, cache, metrics)
        writer.store_many([(k, payload(i)) for i, k in enumerate(names)])
        assert writer.flush(30)
        # A misconfigured node: its slots are smaller than the chunks.
        assert load(writer, names[:1], size=CHUNK // 2) == [None]
        writer.close()
        assert cache.contains(names[0]), "the NVMe copy stays"
    with NVMeCache(tmp_path / "fresh", budget_bytes=10**8) as fresh:
        for prefetch in (0, 256 << 20):
            reader = make_engine(s3_store, fresh, metrics, prefetch_bytes=prefetch)
            if prefetch:
                wait_answers(reader, names[1:])
            assert load(reader, names[1:], size=CHUNK // 2) == [None]
            reader.close()
    assert all(s3_store.exists_many(names)), "the shared objects stay"
    assert sample(metrics, "kvstore:unreadable_chunks_total", tier="nvme") == 1
    assert sample(metrics, "kvstore:unreadable_chunks_total", tier="object") >= 2
    assert sample(metrics, "kvstore:checksum_failures_total", tier="object") == 0


@pytest.mark.parametrize("variant", ["version 1", "newer version", "not a kvstore chunk"])
def test_an_object_this_reader_cannot_read_is_a_miss_and_stays(
    s3_store: ObjectStore, metrics: EngineMetrics, variant: str
) -> None:
    name = keys(1, f"foreign-{variant.replace(' ', '-')}")[0]
    current = bytearray(encode(name, payload(0)).to_bytes())
    blob = {
        "version 1": encode_legacy(payload(0)),
        "newer version": bytes(current[:4]) + b"\x03" + bytes(current[5:]),
        "not a kvstore chunk": payload(0),  # e.g. vLLM's own obj tier writing raw KV under the same layout
    }[variant]
    s3_store.put(name, blob)
    for prefetch in (0, 256 << 20):
        engine = make_engine(s3_store, None, metrics, prefetch_bytes=prefetch)
        if prefetch:
            assert wait_answers(engine, [name]) == [Presence.MISS]
        assert load(engine, [name]) == [None]
        assert engine.get(name) is None
        engine.close()
    assert s3_store.get(name) == blob
    assert sample(metrics, "kvstore:checksum_failures_total", tier="object") == 0


# -- the upload journal: nothing accepted is lost to a slow, failing or absent store, or a restart


class GatedStore(MemoryStore):
    """A real in-memory store whose writes wait on a gate: stands in for a store that has become slow."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.gate.wait(30)
        super().put(key, data)


def test_a_slow_store_never_holds_up_stores(cache: NVMeCache, metrics: EngineMetrics) -> None:
    store = GatedStore()
    engine = make_engine(store, cache, metrics, upload_workers=1)
    names = keys(12, "slow")
    outcome = engine.store_many([(k, payload(i)) for i, k in enumerate(names)])
    assert outcome.written == 12, "stores go to NVMe and the journal whatever the store does"
    assert engine.lookup(names) == [Presence.LOCAL] * 12
    assert sample(metrics, "kvstore:upload_backlog_chunks") >= 11
    assert sample(metrics, "kvstore:upload_backlog_bytes") >= 11 * CHUNK
    store.gate.set()
    assert engine.flush(30)
    assert sample(metrics, "kvstore:upload_backlog_chunks") == 0
    report = engine.close()
    assert report.not_uploaded == 0
    assert all(store.exists_many(names))
    for i, name in enumerate(names):
        blob = store.get(name)
        assert blob is not None and blob[HEADER_BLOCK : HEADER_BLOCK + CHUNK] == payload(i)


def test_uploads_deferred_through_an_outage_all_reach_the_bucket(
    private_s3_server: Any, private_s3_store: ObjectStore, cache: NVMeCache, metrics: EngineMetrics
) -> None:
    server, store = private_s3_server, private_s3_store
    engine = make_engine(store, cache, metrics, cooldown=0.5)
    before = keys(3, "before")
    engine.store_many([(k, payload(i)) for i, k in enumerate(before)])
    assert engine.flush(30)

    server.stop()
    during = keys(20, "during")
    for i in range(0, 20, 5):  # stores keep coming while the store is gone
        outcome = engine.store_many([(k, payload(10 + i + j)) for j, k in enumerate(during[i : i + 5])])
        assert outcome.written == 5
    wait_for(lambda: sample(metrics, "kvstore:object_store_up") == 0, what="the breaker to open")
    # Reads keep working from NVMe while the store is gone.
    assert load(engine, before + during) == [payload(i) for i in range(3)] + [
        payload(10 + i) for i in range(20)
    ]
    assert cache.backlog().chunks == 20

    server.start()
    wait_for(lambda: all(store.exists_many(during)), timeout=60, what="uploads to resume")
    wait_for(lambda: sample(metrics, "kvstore:object_store_up") == 1, what="the breaker to close")
    assert sample(metrics, "kvstore:upload_retries_total") >= 1
    assert sample(metrics, "kvstore:object_store_errors_total", op="put") >= 1
    assert engine.close().not_uploaded == 0
    assert not metrics.registry.get_sample_value("kvstore:uploads_lost_total", {"reason": "evicted"})


def test_uploads_left_at_shutdown_resume_after_a_restart(
    private_s3_server: Any, private_s3_store: ObjectStore, tmp_path: Path, metrics: EngineMetrics
) -> None:
    server, store = private_s3_server, private_s3_store
    names = keys(6, "restart")
    server.stop()
    with NVMeCache(tmp_path / "nvme", budget_bytes=10**8) as cache:
        engine = make_engine(store, cache, metrics, cooldown=0.2)
        assert engine.store_many([(k, payload(i)) for i, k in enumerate(names)]).written == 6
        assert engine.close(flush=True, timeout=0.5).not_uploaded == 6
    server.start()
    with NVMeCache(tmp_path / "nvme", budget_bytes=10**8) as cache:
        engine = make_engine(store, cache, EngineMetrics(CollectorRegistry()))
        assert engine.flush(60)
        engine.close()
    assert all(store.exists_many(names))


def test_a_chunk_evicted_before_its_upload_is_counted(tmp_path: Path, metrics: EngineMetrics) -> None:
    store = GatedStore()  # uploads never finish while the gate is shut
    with NVMeCache(tmp_path / "nvme", budget_bytes=4 * (CHUNK + HEADER_BLOCK)) as cache:
        engine = make_engine(store, cache, metrics, upload_workers=1)
        names = keys(10, "evicted")
        for i, name in enumerate(names):
            engine.store_many([(name, payload(i))])
        lost = sample(metrics, "kvstore:uploads_lost_total", reason="evicted")
        assert lost >= 5
        assert sample(metrics, "kvstore:nvme_evictions_total") >= lost
        store.gate.set()
        assert engine.flush(30)
        engine.close()
    uploaded = sum(store.exists_many(names))
    assert uploaded + lost == 10, "every chunk is either uploaded or counted as lost"


def test_an_nvme_write_failure_is_a_write_failure(tmp_path: Path, metrics: EngineMetrics) -> None:
    with NVMeCache(tmp_path / "nvme", budget_bytes=10**8) as cache:
        engine = make_engine(MemoryStore(), cache, metrics)
        chunks = tmp_path / "nvme" / "chunks"
        shutil.rmtree(chunks)
        chunks.write_bytes(b"not a directory")  # every chunk file write now fails
        outcome = engine.store_many([(k, payload(i)) for i, k in enumerate(keys(3, "write-fail"))])
        assert outcome.failed == 3 and outcome.kept == 0
        assert sample(metrics, "kvstore:write_failures_total", tier="nvme") == 3
        assert sample(metrics, "kvstore:stores_dropped_total", reason="write_error") == 3
        engine.close()


def test_engine_needs_a_tier() -> None:
    with pytest.raises(ConfigError):
        TieredStore(None, None)
