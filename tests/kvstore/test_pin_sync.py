"""A node's pins follow the bucket's manifests (real S3 bucket, real NVMe cache)."""

from __future__ import annotations

import errno
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore import pin_sync
from kvstore.cache.nvme import NVMeCache
from kvstore.cache.records import MAX_KEY_BYTES
from kvstore.hashing import chunk_keys
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.layout import PIN_PREFIX
from kvstore.pin_sync import PinSyncLoop, apply_pins
from kvstore.pins import create_pin, delete_pin
from kvstore.stores.base import ObjectStore
from tests.cache_helpers import admit

NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)


def _keys(n_tokens: int, start: int = 0) -> list[str]:
    return chunk_keys(NS, list(range(start, start + n_tokens)))


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[NVMeCache]:
    with NVMeCache(tmp_path / "nvme", 1 << 20) as c:
        yield c


def test_apply_pins_syncs_node(s3_store: ObjectStore, cache: NVMeCache) -> None:
    a, b = _keys(32), _keys(32, start=500)
    create_pin(s3_store, "a", NS, a)
    create_pin(s3_store, "b", NS, b + a[:1])  # overlapping key: pinned once by the sync
    cache.pin([b[0]])  # someone else's pin must survive our unpin
    sync = apply_pins(cache, s3_store)
    assert (sync.pinned, sync.unpinned, sync.total) == (4, 0, 4)
    assert [cache.pinned(k) for k in a] == [1, 1]
    assert [cache.pinned(k) for k in b] == [2, 1]
    again = apply_pins(cache, s3_store)
    assert (again.pinned, again.unpinned) == (0, 0)
    delete_pin(s3_store, "b")
    sync = apply_pins(cache, s3_store)
    assert (sync.pinned, sync.unpinned) == (0, 2)
    assert [cache.pinned(k) for k in b] == [1, 0]
    assert [cache.pinned(k) for k in a] == [1, 1]
    # Pinned chunks survive eviction pressure once cached.
    blob = b"x" * 400_000
    assert admit(cache, a[0], blob)
    assert admit(cache, b[1], blob)
    assert admit(cache, "other/k.bin", blob)
    assert cache.contains_many([a[0], b[1]]) == [True, False]


def _until(condition: Callable[[], bool], bound_s: float = 30.0) -> bool:
    """Poll `condition()` until true; the bound only ends a broken run (this is not a timing check)."""
    deadline = time.monotonic() + bound_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_pin_sync_loop_follows_the_bucket(s3_store: ObjectStore, cache: NVMeCache) -> None:
    keys = _keys(32)
    loop = PinSyncLoop(cache, s3_store, interval_s=0.05)
    try:
        create_pin(s3_store, "made-elsewhere", NS, keys)
        assert _until(lambda: all(cache.pinned(k) == 1 for k in keys))
        delete_pin(s3_store, "made-elsewhere")
        assert _until(lambda: all(cache.pinned(k) == 0 for k in keys))
    finally:
        loop.stop()


def test_pin_sync_loop_outlives_a_full_disk(
    s3_store: ObjectStore, cache: NVMeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing the record of applied pins fails for a while (no space left): the loop retries, each failed
    run takes its pins back, and once the record can be written every key holds one pin (before: the OSError
    ended its thread, and pins stopped following the bucket until the agent restarted)."""
    keys = _keys(64)
    assert keys
    save = pin_sync._save_applied
    failures: list[int] = []

    def full_disk(path: Path, applied: set[str]) -> None:
        failures.append(len(applied))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pin_sync, "_save_applied", full_disk)
    create_pin(s3_store, "while-full", NS, keys)
    loop = PinSyncLoop(cache, s3_store, interval_s=0.05)
    try:
        assert _until(lambda: len(failures) >= 3), "tried again after the first failure"
        assert [cache.pinned(k) for k in keys] == [0] * len(keys), "no pins counted up by the retries"
        monkeypatch.setattr(pin_sync, "_save_applied", save)
        assert _until(lambda: all(cache.pinned(k) == 1 for k in keys))
        delete_pin(s3_store, "while-full")
        assert _until(lambda: all(cache.pinned(k) == 0 for k in keys)), "and all taken back"
    finally:
        loop.stop()


def test_one_bad_manifest_or_key_never_fails_the_nodes_pins(
    s3_store: ObjectStore, cache: NVMeCache, caplog: pytest.LogCaptureFixture
) -> None:
    # A manifest written before pins were checked against the cache's key limit: one key is too long.
    long = Namespace(model_name="\u20ac" * 200, tokens_per_hash=16, dtype="bfloat16")
    too_long = chunk_keys(long, list(range(16)))
    assert len(too_long[0].encode()) > MAX_KEY_BYTES
    made = create_pin(s3_store, "long", NS, _keys(16))
    doc = {**made.to_json(), "keys": [*made.keys, *too_long]}
    s3_store.put(f"{PIN_PREFIX}long.json", json.dumps(doc).encode())
    good = _keys(32, start=700)
    create_pin(s3_store, "good", NS, good)
    with caplog.at_level(logging.WARNING, logger="kvstore.pin_sync"):
        sync = apply_pins(cache, s3_store)
    assert (sync.pinned, sync.skipped, sync.total) == (3, 1, 3)
    assert all(cache.pinned(k) == 1 for k in [*good, *made.keys])
    assert "long" in caplog.text and f"{MAX_KEY_BYTES}-byte" in caplog.text
    # Later pins apply as usual, and so does taking them back.
    later = _keys(16, start=900)
    create_pin(s3_store, "later", NS, later)
    delete_pin(s3_store, "good")
    again = apply_pins(cache, s3_store)
    assert (again.pinned, again.unpinned, again.skipped) == (1, 2, 1)
    assert cache.pinned(later[0]) == 1 and all(cache.pinned(k) == 0 for k in good)
