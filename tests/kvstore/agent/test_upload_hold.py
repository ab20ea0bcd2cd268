"""The uploader's hold (`upload_hold_s`): while the engines leave no core idle, stored chunks wait for the
bucket, none longer than the hold; with room, they go at once."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvstore.agent.cpu_room import CpuRoom
from kvstore.agent.uploads import OWN_SERVER_HOLD_S, Uploader, upload_hold_of
from kvstore.cache import NVMeCache
from kvstore.chunk import HEADER_BLOCK
from kvstore.config import DataPathSettings
from kvstore.engine import TieredStore
from kvstore.engine.breaker import Breaker
from kvstore.engine.threads import EngineThreads
from kvstore.metrics import EngineMetrics
from kvstore.stores import ObjectStore
from tests.engine_helpers import CHUNK, keys, payload
from tests.helpers import sample, wait_for

pytestmark = pytest.mark.integration


class SetRoom(CpuRoom):
    """The CPUs' answer, set by the test (`CpuRoom`'s reading of /proc/stat has tests of its own)."""

    def __init__(self, room: bool) -> None:
        super().__init__(cpus={0, 1})
        self.room = room
        self.looks = 0

    def has_room(self, window_s: float, stopping: threading.Event) -> bool:
        self.looks += 1
        stopping.wait(window_s)
        return self.room


@contextlib.contextmanager
def uploading(
    cache: NVMeCache, store: ObjectStore, metrics: EngineMetrics, **hold: Any
) -> Iterator[Uploader]:
    """An uploader on a thread of its own, stopped (with its threads) before the block's cache closes."""
    threads = EngineThreads(io_workers=2, disk_workers=2, upload_workers=2)
    uploader = Uploader(
        cache, store, Breaker(1.0, metrics, time.monotonic), metrics, threads, cooldown_s=1.0, **hold
    )
    thread = threading.Thread(target=uploader.run, daemon=True)
    thread.start()
    try:
        yield uploader
    finally:
        uploader.stop()
        thread.join(10)
        threads.join(10)


@contextlib.contextmanager
def stored(
    tmp_path: Path, store: ObjectStore, names: list[str], budget_bytes: int = 1 << 30
) -> Iterator[tuple[NVMeCache, EngineMetrics]]:
    """A cache whose journal holds `names`, stored by an engine (closed again before the cache)."""
    metrics = EngineMetrics(CollectorRegistry())
    with NVMeCache(tmp_path / "nvme", budget_bytes) as cache:
        engine = TieredStore(store, cache, metrics=metrics, threads=EngineThreads(disk_workers=2))
        try:
            for i, name in enumerate(names):
                assert engine.store_many([(name, payload(i))]).written == 1
        finally:
            engine.close()
        yield cache, metrics


def test_with_no_room_uploads_wait_then_go_when_the_cpus_have_room(
    tmp_path: Path, s3_store: ObjectStore
) -> None:
    room = SetRoom(False)
    names = keys(4, "held")
    with (
        stored(tmp_path, s3_store, names) as (cache, metrics),
        uploading(cache, s3_store, metrics, hold_s=600.0, room=room),
    ):
        wait_for(lambda: room.looks >= 5, what="the uploader to look at the CPUs")
        assert cache.backlog().chunks == 4 and not any(s3_store.exists_many(names))
        assert sample(metrics, "kvstore:upload_held_seconds_total") > 0
        room.room = True
        wait_for(lambda: all(s3_store.exists_many(names)), timeout=20, what="the uploads once there is room")


def test_an_uploader_asked_to_stop_while_held_uploads_nothing_more(
    tmp_path: Path, s3_store: ObjectStore
) -> None:
    """Stopping ends the wait for room, and no round follows it (before: a whole round of uploads ran after
    the stop, delaying the agent's exit by as long as its PUTs took)."""
    room = SetRoom(False)
    names = keys(4, "stopped-while-held")
    with stored(tmp_path, s3_store, names) as (cache, metrics):
        with uploading(cache, s3_store, metrics, hold_s=600.0, room=room):
            wait_for(lambda: room.looks >= 2, what="the uploader to look at the CPUs")
        assert not any(s3_store.exists_many(names))
        assert cache.backlog().chunks == 4


def test_no_chunk_waits_longer_than_the_hold(tmp_path: Path, s3_store: ObjectStore) -> None:
    """The CPUs never have room: each chunk still reaches the bucket once it has waited `hold_s`."""
    names = keys(4, "overdue")
    stored_at = time.monotonic()
    with (
        stored(tmp_path, s3_store, names) as (cache, metrics),
        uploading(cache, s3_store, metrics, hold_s=1.0, room=SetRoom(False)),
    ):
        wait_for(lambda: all(s3_store.exists_many(names)), timeout=20, what="the overdue uploads")
        assert time.monotonic() - stored_at >= 1.0


def test_a_quarter_of_the_cache_waiting_is_uploaded_without_room(
    tmp_path: Path, s3_store: ObjectStore
) -> None:
    """Held longer, the journal would fill the cache, and eviction take chunks the bucket lacks."""
    names = keys(2, "quarter")
    with (
        stored(tmp_path, s3_store, names, budget_bytes=8 * (CHUNK + HEADER_BLOCK)) as (cache, metrics),
        uploading(cache, s3_store, metrics, hold_s=600.0, room=SetRoom(False)),
    ):
        wait_for(lambda: all(s3_store.exists_many(names)), timeout=20, what="the uploads of a quarter")


def test_without_a_hold_the_cpus_are_never_asked(tmp_path: Path, s3_store: ObjectStore) -> None:
    room = SetRoom(False)
    names = keys(3, "unheld")
    with (
        stored(tmp_path, s3_store, names) as (cache, metrics),
        uploading(cache, s3_store, metrics, room=room),
    ):
        wait_for(lambda: all(s3_store.exists_many(names)), timeout=20, what="the uploads")
    assert room.looks == 0


def test_by_default_only_uploads_to_the_nodes_own_server_are_held() -> None:
    """Another node may want a chunk of a shared bucket at once; no other node reads its own server."""
    assert upload_hold_of(DataPathSettings()) == OWN_SERVER_HOLD_S > 0
    assert upload_hold_of(DataPathSettings(store_url="s3://shared/kv")) == 0
    assert upload_hold_of(DataPathSettings(store_url="s3://shared/kv", upload_hold_s=5.0)) == 5.0
    assert upload_hold_of(DataPathSettings(upload_hold_s=0.0)) == 0
