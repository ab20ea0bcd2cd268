"""The engine harness itself: a metric the engine does not declare is an error, never a 0."""

from __future__ import annotations

import pytest

from kvstore.connector.harness.engine_runner import EngineRun, UnknownMetric


def run_with(metrics: dict[str, float], names: set[str]) -> EngineRun:
    return EngineRun(
        results=[], metrics=metrics, start_s=0, generate_s=[], wall_s=0, metric_names=frozenset(names)
    )


def test_a_declared_metric_sums_its_label_sets_and_reads_zero_before_it_counted() -> None:
    run = run_with(
        {
            "vllm:kvstore_chunk_hits{engine=0,tier=nvme}": 3,
            "vllm:kvstore_chunk_hits{engine=0,tier=object}": 4,
        },
        {"vllm:kvstore_chunk_hits", "vllm:kvstore_checksum_failures"},
    )
    assert run.metric("vllm:kvstore_chunk_hits") == 7
    assert run.metric("vllm:kvstore_chunk_hits", tier="nvme") == 3
    assert run.metric("vllm:kvstore_chunk_hits", tier="ram") == 0
    assert run.metric("vllm:kvstore_checksum_failures", tier="nvme") == 0  # declared, nothing counted yet


def test_an_unknown_metric_name_raises() -> None:
    run = run_with({"vllm:kvstore_chunk_hits{tier=nvme}": 3}, {"vllm:kvstore_chunk_hits"})
    with pytest.raises(UnknownMetric, match="vllm:kvstore_chunk_hit'"):
        run.metric("vllm:kvstore_chunk_hit")  # a typo, or a metric renamed under the test's feet
    with pytest.raises(UnknownMetric):
        run_with({}, set()).metric("vllm:kvstore_chunk_hits")  # a run whose metrics were lost
