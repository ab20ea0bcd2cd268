"""Access records: batches of used keys land in the bucket, compact and readable by GC."""

from __future__ import annotations

import time
from collections.abc import Iterator
from unittest import mock

import pytest

from kvstore.access import AccessRecorder, read_access_records
from kvstore.gc import run_gc
from kvstore.layout import ACCESS_PREFIX
from kvstore.stores import MemoryStore, ObjectStore
from tests.helpers import FakeClock


def test_batches_are_flushed_deduplicated_and_readable(s3_store: ObjectStore) -> None:
    recorder = AccessRecorder(s3_store, interval_s=3600, max_keys=1000, node="node-a")
    recorder.record(["a/1.bin", "a/2.bin", "a/1.bin"])
    assert recorder.flush()
    recorder.record(f"b/{i}.bin" for i in range(1500))  # past max_keys: flushed by the background thread
    recorder.close()
    batches = list(read_access_records(s3_store))
    keys = [k for _, _, batch in batches for k in batch]
    assert sorted(set(keys)) == sorted({"a/1.bin", "a/2.bin"} | {f"b/{i}.bin" for i in range(1500)})
    assert len(keys) == len(set(keys))
    assert all(info.key.startswith(ACCESS_PREFIX + "") for info in s3_store.list(ACCESS_PREFIX))
    assert all(info.size < 20_000 for info in s3_store.list(ACCESS_PREFIX))


@pytest.mark.slow
def test_unreachable_store_drops_the_batch(private_s3_server: object, private_s3_store: ObjectStore) -> None:
    recorder = AccessRecorder(private_s3_store, interval_s=3600)
    private_s3_server.stop()  # type: ignore[attr-defined]
    recorder.record(["x/1.bin"])
    assert not recorder.flush()
    assert recorder.failed_batches == 1
    recorder.close()


def test_a_record_says_when_its_chunks_were_used_not_when_it_was_written(s3_store: ObjectStore) -> None:
    """The node agent writes records a minute or more after the uses: GC must see the uses' times, or a
    chunk used once long ago looks fresh for as long as the agent held its record."""
    recorder = AccessRecorder(s3_store, interval_s=3600, node="node-a")
    long_ago = time.time() - 7200
    recorder.record(["old/1.bin", "old/2.bin"], at=long_ago)
    recorder.record(["new/1.bin"])
    recorder.record(["old/2.bin"])  # used again now: its newest use counts
    assert recorder.flush()
    recorder.close()
    seen = {k: ts for _, ts, batch in read_access_records(s3_store) for k in batch}
    # In the store's time: this machine's, to the second (the store names whole seconds, and a use is
    # rounded to look younger, never older).
    assert long_ago <= seen["old/1.bin"] <= long_ago + 2
    assert time.time() - seen["old/2.bin"] < 60 and time.time() - seen["new/1.bin"] < 60


@pytest.fixture
def store_clock() -> Iterator[FakeClock]:
    """The clock of a real in-memory store, moved by hand (objects get their `last_modified` from it)."""
    clock = FakeClock(1_700_000_000.0)
    with mock.patch("kvstore.stores.memory.time", clock):
        yield clock


@pytest.mark.parametrize("skew", [-3600.0, 3600.0], ids=["node an hour behind", "node an hour ahead"])
def test_records_are_in_the_stores_time_whatever_the_nodes_clock(store_clock: FakeClock, skew: float) -> None:
    """A node an hour behind the store once made GC (TTL 30 min) delete chunks used seconds before; one an
    hour ahead kept idle chunks an hour longer. Records carry the store's time."""
    store = MemoryStore()
    chunks = [f"m_abc_r0/000/00_g0/{i:064x}.bin" for i in range(5)]
    for key in chunks:
        store.put(key, b"x" * 16)
    store_clock.advance(7200)  # two hours later the node uses them
    recorder = AccessRecorder(store, interval_s=3600, node="node-a", clock=lambda: store_clock.now + skew)
    recorder.record(chunks)
    assert recorder.flush()
    recorder.close()
    (ts,) = {ts for _, ts, _ in read_access_records(store)}
    assert store_clock.now <= ts <= store_clock.now + 1
    store_clock.advance(5)
    report = run_gc(store, ttl_seconds=1800, grace_seconds=0)
    assert report.deleted == 0 and set(chunks) <= {info.key for info in store.list()}
    store_clock.advance(1900)  # past the TTL even from compaction's rounded-up minute
    assert run_gc(store, ttl_seconds=1800, grace_seconds=0).deleted == 5, "idle past the TTL, by the store"
