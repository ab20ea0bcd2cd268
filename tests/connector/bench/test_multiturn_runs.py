"""`bench multiturn --runs N`: the order each run starts the methods in, and what the runs give together
(each method against its own run's baseline, then the median), from reports built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.connector.bench.multiturn import MultiturnReport, Point
from kvstore.connector.bench.multiturn_runs import baseline_of, rotated, summarize_runs, write_runs


def _point(method: str, conversations: int, tokens_per_s: float, host: float, vllm_cpu_s: float) -> Point:
    return Point(
        method=method,
        conversations=conversations,
        requests=96,
        prompt_tokens=300_000,
        cached_tokens=0,
        wall_s=300_000 / tokens_per_s,
        prompt_tokens_per_s=tokens_per_s,
        requests_per_s=1.0,
        ttft_mean_s=0.1,
        ttft_p90_s=0.2,
        last_turn_tokens=3404,
        token_share={"device": 0.0, "host": host, "disk": 0.78 - host, "computed": 0.22},
        storage_hit_rate=None,
        # vLLM's threads are summed; the agent's and the S3 server's are not vLLM's.
        cpu_s={"VLLM::EngineCore": vllm_cpu_s - 1.0, "vllm": 1.0, "agent": 5.0, "s3-server": 7.0},
    )


def _report(*points: Point) -> MultiturnReport:
    return MultiturnReport({}, {}, 3404, 4.8, 9.6, points=list(points))


def test_every_method_takes_every_place_in_turn() -> None:
    methods = ["cpu+ours", "cpu+fs", "cpu+ours-file"]
    orders = [rotated(methods, run) for run in range(4)]
    assert orders == [
        ["cpu+ours", "cpu+fs", "cpu+ours-file"],
        ["cpu+fs", "cpu+ours-file", "cpu+ours"],
        ["cpu+ours-file", "cpu+ours", "cpu+fs"],
        ["cpu+ours", "cpu+fs", "cpu+ours-file"],
    ]
    for place in range(3):
        assert {order[place] for order in orders[:3]} == set(methods)


def test_the_baseline_is_the_fs_tier_when_it_runs() -> None:
    assert baseline_of(["cpu+ours", "cpu+fs"]) == "cpu+fs"
    assert baseline_of(["cpu+ours", "cpu+obj"]) == "cpu+ours"


def test_each_run_is_compared_with_its_own_baseline_and_the_median_is_of_those_ratios() -> None:
    # The machine was slow in run 2 for every method: its raw throughput is low, its ratio is not.
    runs = [
        _report(_point("cpu+ours", 16, 50_000, 0.35, 10.0), _point("cpu+fs", 16, 40_000, 0.40, 12.0)),
        _report(_point("cpu+fs", 16, 20_000, 0.50, 12.0), _point("cpu+ours", 16, 18_000, 0.20, 9.0)),
        _report(_point("cpu+ours", 16, 44_000, 0.57, 11.0), _point("cpu+fs", 16, 44_000, 0.25, 11.0)),
    ]
    rows = {row.method: row for row in summarize_runs(runs, "cpu+fs")}
    ours = rows["cpu+ours"]
    assert ours.prompt_tokens_per_s == [50_000, 18_000, 44_000]
    assert ours.vs_baseline == pytest.approx([1.25, 0.9, 1.0])
    assert ours.median_vs_baseline == pytest.approx(1.0)
    assert ours.cpu_tier_share == [0.35, 0.20, 0.57]
    assert ours.median_cpu_tier_share == pytest.approx(0.35)
    assert ours.vllm_cpu_s == pytest.approx([10.0, 9.0, 11.0])
    assert ours.vllm_cpu_vs_baseline == pytest.approx([10 / 12, 0.75, 1.0])
    assert ours.median_vllm_cpu_vs_baseline == pytest.approx(10 / 12)
    assert rows["cpu+fs"].vs_baseline == [1.0, 1.0, 1.0]


def test_a_run_without_the_baseline_at_a_count_is_left_out_of_that_row(tmp_path: Path) -> None:
    runs = [
        _report(
            _point("cpu+ours", 16, 50_000, 0.3, 10.0),
            _point("cpu+fs", 16, 40_000, 0.4, 10.0),
            _point("cpu+ours", 32, 30_000, 0.0, 20.0),
            _point("cpu+fs", 32, 30_000, 0.0, 20.0),
        ),
        _report(_point("cpu+ours", 16, 45_000, 0.3, 10.0), _point("cpu+fs", 16, 50_000, 0.4, 10.0)),
    ]
    rows = summarize_runs(runs, "cpu+fs")
    by = {(row.conversations, row.method): row for row in rows}
    assert by[16, "cpu+ours"].vs_baseline == pytest.approx([1.25, 0.9])
    assert by[32, "cpu+ours"].vs_baseline == [1.0]
    assert [(row.conversations, row.method) for row in rows] == [
        (16, "cpu+ours"),
        (16, "cpu+fs"),
        (32, "cpu+ours"),
        (32, "cpu+fs"),
    ]

    path = write_runs(rows, [rotated(["cpu+ours", "cpu+fs"], i) for i in range(2)], tmp_path / "out")
    saved = json.loads(path.read_text())
    assert saved["runs"] == [
        {"order": ["cpu+ours", "cpu+fs"], "results": "run-1/multiturn.json"},
        {"order": ["cpu+fs", "cpu+ours"], "results": "run-2/multiturn.json"},
    ]
    first = saved["rows"][0]
    assert (first["conversations"], first["method"], first["baseline"]) == (16, "cpu+ours", "cpu+fs")
    assert first["median_vs_baseline"] == pytest.approx(1.075)
