"""GC against pins created while it runs, on a real S3 server: at every phase of a run, no chunk is deleted
while a pin manifest names it.

A forwarding store around the real one runs a pin creation at a chosen point of the GC (its first listing
page, the access-record merge, right before each delete batch is sent) and checks every delete batch against
the manifests in the bucket at that moment.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from typing_extensions import override

from kvstore import gc as gc_module
from kvstore.access import encode_batch
from kvstore.gc import run_gc
from kvstore.keys import KVCacheGroup, Namespace, make_offload_key
from kvstore.layout import ACCESS_PREFIX, GC_HOLD_PREFIX, GC_MARKER_KEY, PIN_PREFIX, is_chunk_key
from kvstore.pin_fence import fenced_pin_write
from kvstore.pins import PinManifest, create_pin, pinned_keys
from kvstore.stores import ObjectInfo, ObjectStore
from tests.helpers import ForwardingStore

pytestmark = pytest.mark.integration

NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)
BATCH = 40


def chunk(i: int) -> str:
    return NS.chunk_key(make_offload_key(i.to_bytes(32, "big")))


class PhaseStore(ForwardingStore):
    """Forwards to `inner`; calls `at(phase, detail)` at GC's phases and records every chunk deleted while a
    manifest named it (`violations`)."""

    def __init__(self, inner: ObjectStore, at: Callable[[str, Any], None]) -> None:
        super().__init__(inner)
        self._at = at
        self.violations: set[str] = set()
        self.deleted: list[list[str]] = []

    @override
    def get(self, key: str) -> bytes | None:
        if key.startswith(ACCESS_PREFIX):
            self._at("merge", key)
        return self.inner.get(key)

    @override
    def delete_many(self, keys: Sequence[str]) -> None:
        chunks = [k for k in keys if is_chunk_key(k)]
        if chunks:
            self._at("delete", list(chunks))
            self.violations |= set(chunks) & pinned_keys(self.inner)
        self.inner.delete_many(keys)
        if chunks:
            self.deleted.append(list(chunks))
            # A manifest that appeared while the request was in flight counts too.
            self.violations |= set(chunks) & pinned_keys(self.inner)

    @override
    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[ObjectInfo]:
        if prefix == GC_HOLD_PREFIX:
            self._at("holds", None)  # the fence looking for pin creators between their hold and manifest
        for i, info in enumerate(self.inner.list(prefix, start_after)):
            if prefix == "" and i == 0:
                self._at("listing", info.key)
            yield info


def _create_pin_concurrently(store: ObjectStore, name: str, keys: list[str]) -> threading.Thread:
    """Create the pin on another thread, and return once it is written or waiting at the fence (its hold is
    in the bucket): then GC's own thread goes on, exactly as it would with a creator on another machine."""
    done = threading.Event()

    def create() -> None:
        try:
            create_pin(store, name, NS, keys)
        finally:
            done.set()

    thread = threading.Thread(target=create, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not done.is_set() and not any(True for _ in store.list(GC_HOLD_PREFIX)):
        assert time.monotonic() < deadline, "the pin creation neither finished nor reached the fence"
        time.sleep(0.005)
    return thread


@pytest.fixture
def bucket(s3_store: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[ObjectStore, list[str], float]:
    monkeypatch.setattr(gc_module, "DELETE_BATCH", BATCH)  # several delete batches from a few hundred chunks
    keys = [chunk(i) for i in range(6 * BATCH)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: s3_store.put(k, b"x" * 16), keys))
    s3_store.put(f"{ACCESS_PREFIX}2026010100/test-0.json.zst", encode_batch(keys[:3], 1.0))
    t0 = max(info.last_modified for info in s3_store.list())
    return s3_store, keys, t0


@pytest.mark.slow
def test_a_pin_created_at_any_phase_of_a_gc_loses_no_chunk(
    bucket: tuple[ObjectStore, list[str], float],
) -> None:
    store, keys, t0 = bucket
    order = [info.key for info in store.list() if is_chunk_key(info.key)]  # GC deletes in listing order
    creators: list[threading.Thread] = []
    created: dict[str, list[str]] = {}
    batches_seen = 0

    def at(phase: str, detail: Any) -> None:
        nonlocal batches_seen
        if phase in ("listing", "merge") and phase not in created:
            # Chunks every batch would otherwise delete: the first, a middle and the last one.
            created[phase] = [order[0], order[len(order) // 2], order[-1]]
            creators.append(_create_pin_concurrently(store, phase, created[phase]))
        elif phase == "delete":
            batches_seen += 1
            name = f"batch-{batches_seen}"
            later = order[order.index(detail[-1]) + 1 :]
            # Two chunks of the batch being sent, two of later batches.
            created[name] = [detail[0], detail[-1], *later[:1], *later[-1:]]
            creators.append(_create_pin_concurrently(store, name, created[name]))

    phased = PhaseStore(store, at)
    report = run_gc(phased, ttl_seconds=0, grace_seconds=0, now=t0 + 10)
    for thread in creators:
        thread.join(30)
    assert set(created) >= {"listing", "merge", "batch-1", "batch-2"}
    assert phased.violations == set(), f"{len(phased.violations)} chunks deleted while a pin named them"
    # Every pin's chunks that were still there when its manifest appeared are there now.
    survivors = {info.key for info in store.list() if is_chunk_key(info.key)}
    for name in ("listing", "merge"):
        assert set(created[name]) <= survivors, name
    assert report.kept_pinned == len(survivors) and report.deleted == len(keys) - len(survivors)
    assert report.pin_manifests >= 2
    # The fence leaves nothing behind.
    assert store.get(GC_MARKER_KEY) is None and not list(store.list(GC_HOLD_PREFIX))


@pytest.mark.slow
def test_gc_waits_for_a_creator_between_its_hold_and_its_manifest(
    bucket: tuple[ObjectStore, list[str], float],
) -> None:
    store, keys, t0 = bucket
    in_hold = threading.Event()
    release = threading.Event()

    def slow_write() -> None:
        """The manifest write `create_pin` does inside the fence, after a long pause."""
        in_hold.set()
        assert release.wait(20)
        manifest = PinManifest("held", NS.id, NS.fields(), tuple(keys[:BATCH]), time.time())
        store.put(f"{PIN_PREFIX}held.json", manifest.encode())

    creator = threading.Thread(target=lambda: fenced_pin_write(store, slow_write), daemon=True)
    creator.start()
    assert in_hold.wait(20)
    result: list[Any] = []
    looks = threading.Semaphore(0)
    watched = PhaseStore(store, lambda phase, _: looks.release() if phase == "holds" else None)
    gc = threading.Thread(
        target=lambda: result.append(run_gc(watched, ttl_seconds=0, grace_seconds=0, now=t0 + 10))
    )
    gc.start()
    # GC found the hold at its first delete batch and looks again (it waits): nothing may be deleted yet.
    for _ in range(3):
        assert looks.acquire(timeout=30), "GC never reached the fence"
    assert watched.deleted == [] and all(store.exists_many(keys))
    release.set()
    creator.join(20)
    gc.join(60)
    report = result[0]
    assert all(store.exists_many(keys[:BATCH])) and report.kept_pinned == BATCH
    assert report.deleted == len(keys) - BATCH and report.pin_fence_wait_s > 0


def test_holds_of_crashed_creators_neither_block_gc_nor_pile_up(
    bucket: tuple[ObjectStore, list[str], float],
) -> None:
    store, keys, t0 = bucket
    store.put(f"{GC_HOLD_PREFIX}crashed-long-ago.json", json.dumps({"until": time.time() - 7200}).encode())
    store.put(f"{GC_HOLD_PREFIX}crashed-just-now.json", json.dumps({"until": time.time() - 1}).encode())
    store.put(f"{GC_HOLD_PREFIX}torn.json", b"{not json")
    report = run_gc(store, ttl_seconds=0, grace_seconds=0, now=t0 + 10)
    assert report.deleted == len(keys) and report.pin_fence_wait_s == 0
    left = {info.key for info in store.list(GC_HOLD_PREFIX)}
    assert left == {f"{GC_HOLD_PREFIX}crashed-just-now.json"}  # an unreadable hold counts as long expired


def test_the_marker_of_a_gc_killed_on_this_machine_never_holds_pin_creation_back() -> None:
    from kvstore.lease import lease_key, this_process
    from kvstore.stores import MemoryStore

    store = MemoryStore("killed-gc")
    me = this_process()
    assert me is not None, "this test needs /proc"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    process = {"machine": me.machine, "pid": dead.pid, "started": "1"}
    lease = {"holder": "killed", "token": "k" * 32, "expires_at": time.time() + 300, "process": process}
    store.put(lease_key("gc"), json.dumps(lease).encode())
    store.put(
        GC_MARKER_KEY,
        json.dumps({"token": "k" * 32, "holder": "killed", "until": time.time() + 120}).encode(),
    )
    began = time.monotonic()
    assert fenced_pin_write(store, lambda: "written", wait_s=5) == "written"
    assert time.monotonic() - began < 2
