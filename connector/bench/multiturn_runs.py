"""`bench multiturn --runs N`: the sweep repeated, the methods' order rotated, and what the runs say together.

On a shared machine one run is not a measurement: the engines' speed moves between runs, and whichever method
runs first or last pays for it. So each run starts one method later than the one before (every method takes
every place in turn), each method is compared with the baseline of its own run, and the median of those
ratios is the figure to quote, beside every run's own.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstore.connector.bench.multiturn import MultiturnReport

__all__ = ["RunsRow", "baseline_of", "rotated", "run_folder", "summarize_runs", "write_runs"]


def rotated(methods: Sequence[str], run: int) -> list[str]:
    """The methods' order in run ``run`` (from 0): the list turned left by ``run`` places."""
    if not methods:
        return []
    k = run % len(methods)
    return [*methods[k:], *methods[:k]]


def run_folder(index: int) -> str:
    """Where run ``index`` (from 0) keeps its results, under the benchmark's folder."""
    return f"run-{index + 1}"


def baseline_of(methods: Sequence[str]) -> str:
    """What every method is compared with: vLLM's fs tier when it runs, else the first method named."""
    return "cpu+fs" if "cpu+fs" in methods else methods[0]


@dataclass(frozen=True)
class RunsRow:
    """One method at one conversation count over the runs, each list in run order."""

    conversations: int
    method: str
    baseline: str
    prompt_tokens_per_s: list[float]
    vs_baseline: list[float]  # this run's throughput over the baseline's in the same run
    cpu_tier_share: list[float]  # of prompt tokens
    vllm_cpu_s: list[float]  # vLLM's process group, during the point
    vllm_cpu_vs_baseline: list[float]

    @property
    def median_vs_baseline(self) -> float:
        return statistics.median(self.vs_baseline)

    @property
    def median_cpu_tier_share(self) -> float:
        return statistics.median(self.cpu_tier_share)

    @property
    def median_vllm_cpu_vs_baseline(self) -> float:
        return statistics.median(self.vllm_cpu_vs_baseline)


def summarize_runs(reports: Sequence[MultiturnReport], baseline: str) -> list[RunsRow]:
    """Per conversation count and method (the baseline too, at 1.00x), every run's figures against the
    baseline's in that run. A run that lacks the method or the baseline at a count is left out of that row."""
    rows: list[RunsRow] = []
    counts = sorted({p.conversations for r in reports for p in r.points})
    methods = list(dict.fromkeys(p.method for r in reports for p in r.points))
    indexed = [{(p.method, p.conversations): p for p in r.points} for r in reports]
    for n in counts:
        for method in methods:
            pairs = [
                (ours, base)
                for by in indexed
                if (ours := by.get((method, n))) is not None and (base := by.get((baseline, n))) is not None
            ]
            if not pairs:
                continue
            rows.append(
                RunsRow(
                    conversations=n,
                    method=method,
                    baseline=baseline,
                    prompt_tokens_per_s=[o.prompt_tokens_per_s for o, _ in pairs],
                    vs_baseline=[o.prompt_tokens_per_s / b.prompt_tokens_per_s for o, b in pairs],
                    cpu_tier_share=[o.token_share.get("host", 0.0) for o, _ in pairs],
                    vllm_cpu_s=[o.vllm_cpu_s for o, _ in pairs],
                    vllm_cpu_vs_baseline=[o.vllm_cpu_s / max(b.vllm_cpu_s, 1e-9) for o, b in pairs],
                )
            )
    return rows


def write_runs(rows: Sequence[RunsRow], orders: Sequence[Sequence[str]], out_dir: Path) -> Path:
    """`runs.json` under `out_dir`: each run's order and folder, and every row with its medians."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "runs.json"
    summary = {
        "runs": [
            {"order": list(order), "results": f"{run_folder(i)}/multiturn.json"}
            for i, order in enumerate(orders)
        ],
        "rows": [
            {
                **asdict(row),
                "median_vs_baseline": row.median_vs_baseline,
                "median_cpu_tier_share": row.median_cpu_tier_share,
                "median_vllm_cpu_vs_baseline": row.median_vllm_cpu_vs_baseline,
            }
            for row in rows
        ],
    }
    path.write_text(json.dumps(summary, indent=2))
    return path
