"""vLLM's metrics as the harness reads them: a flat snapshot, "name{label=value,...}" (labels sorted) ->
value, from an engine in a subprocess (`engine_runner`) or a server's `/metrics` (`vllm_server`), summed over
the label sets a caller names."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["metric_delta", "metric_total", "parse_metrics"]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> flat samples (`_created` stamps dropped)."""
    flat: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            flat[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return flat


def metric_total(snapshot: Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of `name` over every label set in `snapshot` that includes `labels` (0 where none does)."""
    total = 0.0
    for key, value in snapshot.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv)
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


def metric_delta(before: Mapping[str, float], after: Mapping[str, float], name: str, **labels: str) -> float:
    """What `name` (summed as `metric_total` does) grew by from one snapshot to a later one."""
    return metric_total(after, name, **labels) - metric_total(before, name, **labels)
