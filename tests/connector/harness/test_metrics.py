"""The harness's metric snapshots: Prometheus text flattened the way the engine runner names samples, and sums
over label sets."""

from __future__ import annotations

from kvstore.connector.harness.metrics import metric_delta, metric_total, parse_metrics

_TEXT = """\
# HELP vllm:kvstore_chunk_hits Chunk hits.
# TYPE vllm:kvstore_chunk_hits counter
vllm:kvstore_chunk_hits_total{tier="nvme",engine="0"} 3.0
vllm:kvstore_chunk_hits_created{tier="nvme",engine="0"} 1.7e9
vllm:kvstore_chunk_hits_total{tier="object",engine="0"} 4.0
# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running 2.0
"""


def test_text_flattens_to_sorted_labels_without_created_stamps() -> None:
    assert parse_metrics(_TEXT) == {
        "vllm:kvstore_chunk_hits_total{engine=0,tier=nvme}": 3.0,
        "vllm:kvstore_chunk_hits_total{engine=0,tier=object}": 4.0,
        "vllm:num_requests_running": 2.0,
    }


def test_totals_sum_the_label_sets_that_match_and_deltas_subtract() -> None:
    after = parse_metrics(_TEXT)
    assert metric_total(after, "vllm:kvstore_chunk_hits_total") == 7
    assert metric_total(after, "vllm:kvstore_chunk_hits_total", tier="object") == 4
    assert metric_total(after, "vllm:kvstore_chunk_hits_total", tier="ram") == 0
    assert metric_total(after, "vllm:num_requests_running") == 2
    before = {"vllm:kvstore_chunk_hits_total{engine=0,tier=nvme}": 1.0}
    assert metric_delta(before, after, "vllm:kvstore_chunk_hits_total", tier="nvme") == 2
    assert metric_delta(before, after, "vllm:kvstore_chunk_hits_total") == 6
