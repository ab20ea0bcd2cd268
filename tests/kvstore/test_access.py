"""Access records: batches of used keys land in the bucket, compact and readable by GC."""

from __future__ import annotations

import time

import pytest

from kvstore.access import AccessRecorder, read_access_records
from kvstore.layout import ACCESS_PREFIX
from kvstore.stores import ObjectStore


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
    assert seen["old/1.bin"] == long_ago
    assert time.time() - seen["old/2.bin"] < 60 and time.time() - seen["new/1.bin"] < 60
