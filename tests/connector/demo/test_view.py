"""What `kvstore demo` prints, at 80 columns and narrower, on a terminal or into a file: URLs whole on one
line, table cells complete (folded, never cut to "…"), the new node's TTFT beside its recompute."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvstore.connector.demo.run import DemoReport, TierCounts
from kvstore.connector.demo.view import _print_report
from kvstore.connector.harness.multiturn import TurnRecord

ADMIN = "http://127.0.0.1:48750"
VLLM = "http://127.0.0.1:39123"
NEW = "http://127.0.0.1:39124"


def _report() -> DemoReport:
    report = DemoReport(admin_url=ADMIN, vllm_url=VLLM, new_node_url=NEW)
    report.turns = [
        TurnRecord(
            conversation=c,
            turn=t,
            prompt_tokens=1500 + 300 * t,
            cached_tokens=1200 * t,
            ttft_s=0.5 / (t + 1),
            latency_s=0.6 / (t + 1),
        )
        for c in range(3)
        for t in range(2)
    ]
    report.prompt_tokens = 20_000
    report.token_sources = {"device": 5_000.0, "host": 3_000.0, "disk": 9_000.0}
    report.kvstore_tiers = {"nvme": TierCounts(35, 35), "object": TierCounts(0, 0)}
    report.new_node_tiers = {"nvme": TierCounts(23, 0), "object": TierCounts(23, 23)}
    report.returning_hit_s, report.returning_recompute_s, report.returning_hit_tokens = 0.11, 1.2, 2944
    report.new_node_hits_s, report.new_node_recomputes_s = [0.3, 0.16, 0.12], [1.25, 1.1, 1.4]
    report.new_node_hit_tokens = 2944
    return report


@pytest.mark.parametrize("width", [80, 60])
def test_urls_stay_whole_and_cells_complete(width: int) -> None:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, color_system=None)
    _print_report(console, _report())
    text = out.getvalue()
    lines = text.splitlines()
    for url in (
        f"{VLLM}/metrics",
        f"{NEW}/metrics",
        f"{ADMIN}/docs",
        f"{ADMIN}/v1/stats",
        "http://127.0.0.1:3000",
    ):
        assert any(url in line for line in lines), f"{url} is broken across lines at {width} columns:\n{text}"
    assert "…" not in text  # a narrow table folds its cells instead of cutting them
    assert "100% (23 of 23)" in text.replace("\n", " ") or "(23 of 23)" in text
    flat = " ".join(text.split())
    assert "A new node with an empty NVMe cache" in flat and "23 chunks from the object store" in flat
    # The medians of the three returning users (0.160 s, 1.250 s), and each user's pair.
    assert "3 returning users" in flat and "median TTFT 0.160 s" in flat and "1.250 s recomputed" in flat
    assert "7.8x faster" in flat and "0.300 vs 1.250 s, 0.160 vs 1.100 s, 0.120 vs 1.400 s" in flat
