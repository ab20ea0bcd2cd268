"""The engine harness itself: a metric the engine does not declare is an error, never a 0; what an engine left
in /dev/shm is told apart from what another test's engine frees for a moment as it stops."""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import pytest

from kvstore.connector.harness import engine_runner
from kvstore.connector.harness.engine_runner import EngineRun, UnknownMetric, new_shm, shm_snapshot


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


def test_a_leftover_is_reported_and_an_entry_removed_meanwhile_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A /dev/shm of its own: an engine stopping in another test meanwhile would clean up these entries too.
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(engine_runner, "SHM", shm)
    before = shm_snapshot()
    leaked = shm / f"psm_kvstore_test_{uuid.uuid4().hex[:8]}"
    passing = shm / f"psm_kvstore_test_{uuid.uuid4().hex[:8]}"
    leaked.write_bytes(b"x")
    passing.write_bytes(b"x")
    # Another test's engine stopped a moment ago: its harness removes its entry a second later.
    remover = threading.Timer(1.0, os.unlink, args=(passing,))
    remover.start()
    try:
        assert new_shm(before, settle_s=3.0) == {leaked.name}
    finally:
        remover.cancel()
        leaked.unlink()
        passing.unlink(missing_ok=True)
    assert new_shm(before, settle_s=0) == set()
