"""KVStoreTier against vLLM's tier API as 0.32 and 0.33 define it, outside an engine (`.ci/compat` runs this
file against vLLM 0.33 too): jobs that cannot run, transfer times, localities, KV events as vLLM's own
tracker and decoder see them, calls from more than one thread, the GIL switch default, 0.33's optional
members.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not installed")

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import events as vllm_events
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingKVEventsConfig,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

from kvstore.agent.uploads import wait_uploaded
from kvstore.connector.harness.standalone import StandaloneTier, standalone_spec, standalone_tier
from kvstore.connector.tier import KVStoreTier
from kvstore.errors import ConfigError
from kvstore.events import OWNERSHIP
from tests.connector.tier_jobs import CHUNK, REQ, data, job, okey, wait_jobs

pytestmark = pytest.mark.slow


@pytest.fixture
def make_tier(tmp_path: Path) -> Iterator[Callable[..., StandaloneTier]]:
    """Tiers over a memory:// store (shared by name within the process) and an NVMe cache of their own."""
    built: list[StandaloneTier] = []

    def make(name: str = "a", **options: Any) -> StandaloneTier:
        opts = {"store_url": f"memory://compat-{tmp_path.name}", "cache_dir": str(tmp_path / name)}
        opts.setdefault("cache_bytes", 1 << 30)
        opts.update(options)
        tier = standalone_tier(opts, chunk_bytes=CHUNK, num_chunks=8, kv_events=True)
        built.append(tier)
        return tier

    yield make
    for tier in built:
        tier.close()


def test_chunk_ids_outside_the_primary_region_fail_their_job_only(make_tier: Callable[..., Any]) -> None:
    node = make_tier()
    tier = node.tier
    node.fill(0, data(0))
    # Two stores in one batch: the one that names row 8 of an 8-row region fails; the other stores.
    tier.submit_store(job(1, [okey(1)], [8], promotion=False))
    tier.submit_store(job(2, [okey(0)], [0], promotion=False))
    tier.submit_store(job(3, [okey(3)], [-1], promotion=False))
    results = wait_jobs(tier, {1, 2, 3})
    assert (results[1].success, results[2].success, results[3].success) == (False, True, False)
    assert tier.lookup(okey(1), REQ) is not LookupResult.HIT  # no header-only chunk was stored
    assert tier.lookup(okey(0), REQ) is LookupResult.HIT
    tier.submit_load(job(4, [okey(0)], [99], promotion=True))
    tier.submit_load(job(5, [okey(0)], [5], promotion=True))
    loads = wait_jobs(tier, {4, 5})
    assert not loads[4].success and loads[5].success
    assert bytes(node.slot(5)) == data(0)


def test_every_job_reports_its_bytes_and_seconds(make_tier: Callable[..., Any]) -> None:
    node = make_tier()
    tier = node.tier
    for i in range(3):
        node.fill(i, data(i))
    tier.submit_store(job(1, [okey(i) for i in range(3)], [0, 1, 2], promotion=False))
    stored = wait_jobs(tier, {1})[1]
    tier.submit_load(job(2, [okey(2), okey(0)], [4, 5], promotion=True))
    loaded = wait_jobs(tier, {2})[2]
    for result, chunks in ((stored, 3), (loaded, 2)):
        assert result.success and result.transfer_bytes == chunks * CHUNK
        # vLLM's per-tier read and write time series are fed from this.
        assert result.transfer_time is not None and 0 < result.transfer_time < 30


def test_localities_are_honoured_and_empty_ones_refused(make_tier: Callable[..., Any]) -> None:
    for bad in ("", "remote", "NEARBY"):
        with pytest.raises(ConfigError, match="locality"):
            make_tier("bad", locality=bad)
        with pytest.raises(ConfigError, match="object_locality"):
            make_tier("bad", object_locality=bad)
    assert make_tier("default").tier.locality is Locality.LOCAL
    node = make_tier("remote", locality="REMOTE", object_locality="LOCAL", enable_kv_events=True)
    assert node.tier.locality is Locality.REMOTE  # what vLLM's per-request tier filters read
    node.fill(0, data(0))
    node.tier.submit_store(job(1, [okey(0)], [0], promotion=False))
    wait_jobs(node.tier, {1})
    assert wait_uploaded(node.tier.engine.cache, 10)
    # One residency per chunk, with the tier's own locality and no ownership; the upload adds no event.
    events = list(node.tier.take_events())
    assert [(e.removed, e.medium, e.locality, e.ownership, e.removal_expected) for e in events] == [
        (False, Medium.STORAGE, Locality.REMOTE, OWNERSHIP, False)
    ]


def _seeded_tracker(keys: list[bytes]) -> Any:
    """vLLM's events tracker with self-describing payloads, holding a payload for each key, as the scheduler
    leaves it after storing them (it records the payload from the request, which a tier never sees)."""
    tracker = vllm_events.OffloadingEventsTracker(OffloadingKVEventsConfig(True, True))
    for i, key in enumerate(keys):
        tracker._pending_event_metadata[key] = vllm_events._OffloadEventMetadata(
            block_hashes=(key[:-4],),
            parent_block_hash=None,
            token_ids=tuple(range(i * 16, i * 16 + 16)),
            block_size=16,
            lora_id=None,
            lora_name=None,
            extra_keys=None,
            group_idx=0,
            kv_cache_spec=vllm_events.OffloadingEventGroupSpec(None, None),
            active_residencies=set(),
        )
    return tracker


def test_an_nvme_eviction_leaves_the_bucket_copy_to_routers(make_tier: Callable[..., Any]) -> None:
    # An NVMe cache of two chunks: storing four evicts the first two, which stay in the bucket.
    node = make_tier(cache_bytes=2 * (CHUNK + 8192), enable_kv_events=True)
    tier = node.tier
    keys = [okey(i) for i in range(4)]
    tracker = _seeded_tracker(keys)
    translated: list[Any] = []
    for i, key in enumerate(keys):
        node.fill(i, data(i))
        tier.submit_store(job(i, [key], [i], promotion=False))
        wait_jobs(tier, {i})
        assert wait_uploaded(tier.engine.cache, 10)  # uploaded first: eviction takes uploaded chunks
        translated += list(tracker.take_events(list(tier.take_events())))
    assert tier.engine.cache is not None
    on_nvme = tier.engine.cache.contains_many([tier.namespace.chunk_key(k) for k in keys])
    assert not all(on_nvme), "the tiny NVMe cache evicted nothing"
    # The evicted chunks are in the bucket: this node still holds them, so no BlockRemoved ends the residency.
    assert not [e for e in translated if isinstance(e, BlockRemoved)]
    # The stores registered no residency with vLLM's tracker: it keeps a payload only while the CPU tier
    # holds the chunk, not for as long as the bucket does.
    for key in keys:
        meta = tracker._pending_event_metadata.get(key)
        assert meta is not None and not meta.active_residencies

    # On the wire, as vLLM's publisher encodes them and its own decoder (and the routers on it) read them.
    batch = KVEventBatch(ts=time.time(), events=translated, data_parallel_rank=0)
    decoded = msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.Encoder().encode(batch))
    stored = [e for e in decoded.events if isinstance(e, BlockStored)]
    assert len(stored) == len(keys), "one BlockStored per chunk: its upload is not announced again"
    assert {(e.medium, e.locality, e.ownership) for e in stored} == {("STORAGE", "LOCAL", None)}
    assert all(len(e.token_ids) == 16 for e in stored)  # self-describing payloads, not placeholders


def test_calls_from_two_threads_under_one_lock(make_tier: Callable[..., Any]) -> None:
    """vLLM 0.33 calls a tier under its manager's lock from the scheduler thread and from its tier-poll
    thread. Lookups from one thread, step ends and job polls from another: the tier answers all the same."""
    writer = make_tier("w")
    writer.fill(0, data(0))
    writer.tier.submit_store(job(1, [okey(0)], [0], promotion=False))
    wait_jobs(writer.tier, {1})
    assert wait_uploaded(writer.tier.engine.cache, 10)

    tier = make_tier("r").tier
    lock = threading.Lock()
    answers: dict[str, LookupResult] = {}
    stop = threading.Event()

    def scheduler() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not stop.is_set():
            with lock:
                answers["hit"] = tier.lookup(okey(0), REQ)
                answers["miss"] = tier.lookup(okey(77), REQ)
            if LookupResult.RETRY not in answers.values():
                return
            time.sleep(0.005)

    def poller() -> None:
        while not stop.is_set():
            with lock:
                tier.on_schedule_end(None)  # type: ignore[arg-type]
                list(tier.get_finished_jobs())
            time.sleep(0.005)

    threads = [threading.Thread(target=scheduler), threading.Thread(target=poller)]
    for thread in threads:
        thread.start()
    threads[0].join()
    stop.set()
    threads[1].join()
    assert answers == {"hit": LookupResult.HIT, "miss": LookupResult.MISS}
    assert KVStoreTier.tolerates_off_thread_polling is False
    # The hit is answered as its GET returns, a moment before the fetch behind it ends: pending until then.
    deadline = time.monotonic() + 10
    while tier.has_pending_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not tier.has_pending_work()


def test_gil_switch_interval_defaults_on_only_with_the_cpu_spec(
    make_tier: Callable[..., Any], tmp_path: Path
) -> None:
    normal = sys.getswitchinterval()
    gpu = make_tier("gpu")  # the stock spec's stand-in: not the CPU spec
    gpu.fill(0, data(0))
    gpu.tier.submit_store(job(1, [okey(0)], [0], promotion=False))
    wait_jobs(gpu.tier, {1})
    gpu.tier.submit_load(job(2, [okey(0)], [1], promotion=True))
    assert sys.getswitchinterval() == pytest.approx(normal)  # off: never measured on a GPU
    wait_jobs(gpu.tier, {2})
    assert gpu.tier.config_info()["kvstore_gil_switch_interval_s"] == 0.0
    assert make_tier("set", gil_switch_interval_s=0.0001).tier.config_info()[
        "kvstore_gil_switch_interval_s"
    ] == pytest.approx(0.0001)
    with pytest.raises(ConfigError, match="gil_switch_interval_s"):
        make_tier("neg", gil_switch_interval_s=-1)

    pytest.importorskip("torch")
    from kvstore.connector.cpu import CPUTieringSpec

    config = dataclasses.replace(standalone_spec().config, extra_config={"cpu_bytes_to_use": 4 * CHUNK})
    spec = CPUTieringSpec(config)
    primary = bytearray(CHUNK * 4)
    view = memoryview(primary).cast("b", (4, CHUNK))
    tier = KVStoreTier(spec, view, "KVStoreTier", store_url="memory://cpu", cache_dir=str(tmp_path / "cpu"))
    try:
        assert tier.config_info()["kvstore_gil_switch_interval_s"] == pytest.approx(0.00002)
    finally:
        tier.shutdown()
        view.release()


def test_optional_members_of_the_033_api(make_tier: Callable[..., Any]) -> None:
    tier = make_tier().tier
    keys = KVStoreTier.config_info_keys({"type": "KVStoreTier"})
    info = tier.config_info()
    assert tuple(info) == keys and "tier" not in keys  # vLLM adds the tier label itself
    assert info["kvstore_namespace"] == tier.namespace.id and info["kvstore_hash_algo"] == "sha256"
    assert all(isinstance(v, str | int | float | bool) for v in info.values())
    base = SecondaryTierManager.__dict__
    if "config_info_keys" in base:  # vLLM >= 0.33: ours override the base's members
        assert KVStoreTier.config_info is not base["config_info"]
        assert "tolerates_off_thread_polling" in base


@pytest.fixture
def engine_none_hash(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str | None], None]]:
    """Set vLLM's NONE_HASH as an engine core does at start-up, for an algorithm and PYTHONHASHSEED."""
    from vllm.utils import hashing as vllm_hashing
    from vllm.v1.core import kv_cache_utils

    def init(algo: str, seed: str | None) -> None:
        if seed is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        kv_cache_utils.init_none_hash(vllm_hashing.get_hash_fn_by_name(algo))

    yield init
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_cache_utils.init_none_hash(vllm_hashing.sha256)


def _published(tier: KVStoreTier) -> None:
    """Wait for the tier's start-up thread that describes the namespace in the bucket."""
    for thread in threading.enumerate():
        if thread.name == "kvstore-tier-namespace":
            thread.join(10)


def test_the_tier_records_its_keys_and_warns_when_they_cannot_be_shared(
    make_tier: Callable[..., Any],
    engine_none_hash: Callable[[str, str | None], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvstore.key_scheme import namespace_schemes, scheme_for

    engine_none_hash("sha256", None)
    first = make_tier("first").tier
    _published(first)
    assert first.key_scheme == scheme_for("sha256")  # what pins and warm compute with vLLM's defaults
    store = first._node.store
    assert namespace_schemes(store, first.namespace) == [first.key_scheme]
    assert "never" not in caplog.text

    engine_none_hash("sha256_cbor", "7")  # another engine, another algorithm and seed: same namespace
    second = make_tier("second").tier
    _published(second)
    assert second.key_scheme.hash_algo == "sha256_cbor" and second.namespace.id == first.namespace.id
    assert "other key scheme(s) already write namespace" in caplog.text
    assert len(namespace_schemes(store, first.namespace)) == 2

    caplog.clear()
    engine_none_hash("xxhash", None)  # random per process: nothing it stores is ever found again
    third = make_tier("third").tier
    _published(third)
    assert third.key_scheme.hash_algo is None and not third.key_scheme.shareable
    assert "random per-process seed" in caplog.text
    assert third.config_info()["kvstore_keys_shareable"] is False
