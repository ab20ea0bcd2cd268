"""`kvstore.stats.node_stats` against a real S3 server and a real NVMe cache."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.gc import run_gc
from kvstore.hashing import chunk_keys
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.pins import create_pin
from kvstore.runtime import Node
from kvstore.stats import bucket_size, node_stats
from tests.engine_helpers import load
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)


@pytest.fixture
def node(s3_server: Any, s3_store: Any, open_test_node: Callable[..., Node]) -> Node:
    return open_test_node(s3_server, f"s3://{s3_store.bucket}/{s3_store.prefix}", cache_bytes=16 << 20)


def test_empty_node(node: Node) -> None:
    stats = node_stats(node)
    assert stats["store"]["reachable"] is True
    assert stats["bucket"] == {"skipped": False, "chunk_objects": 0, "chunk_bytes": 0}
    assert stats["nvme"]["entries"] == 0 and stats["nvme"]["budget_bytes"] == 16 << 20
    assert stats["tiers"]["nvme"]["hit_rate"] is None  # no queries yet: no rate, not 0
    assert stats["pins"] == {"count": 0, "live": 0} and stats["last_gc"] is None
    assert stats["upload_backlog"] == {"chunks": 0, "bytes": 0}
    json.dumps(stats)  # JSON-ready


def test_figures_after_traffic(node: Node) -> None:
    keys = chunk_keys(NS, list(range(96)))  # 6 chunks
    node.engine.store_many([(k, bytes(1000)) for k in keys])
    assert node.flush(30)
    node.store.put("_meta/access/x.bin", b"meta objects are not chunks")
    node.engine.lookup([*keys[:3], "ns_r0/abc/de_g0/missing.bin"], wait=True)
    create_pin(node.store, "sys", NS, keys[:2])
    create_pin(node.store, "old", NS, keys[:1], ttl_seconds=1e-6)
    run_gc(node.store, ttl_seconds=3600, grace_seconds=600, dry_run=True)

    node.engine.publish_counters()
    stats = node_stats(node)
    assert stats["bucket"]["chunk_objects"] == 6
    assert stats["bucket"]["chunk_bytes"] == sum(o.size for o in node.store.list() if o.key in keys)
    assert stats["nvme"]["entries"] == 6 and stats["nvme"]["used_bytes"] > 6000
    assert 0 < stats["nvme"]["used_fraction"] < 1
    nvme = stats["tiers"]["nvme"]
    assert (nvme["queries"], nvme["hits"], nvme["hit_rate"]) == (4, 3, 0.75)
    assert stats["tiers"]["object"]["queries"] == 1 and stats["tiers"]["object"]["hits"] == 0
    assert stats["pins"] == {"count": 2, "live": 1}
    assert stats["last_gc"]["dry_run"] is True and stats["last_gc"]["objects"] == 6

    skipped = node_stats(node, scan_bucket=False)
    assert skipped["bucket"] == {"skipped": True}
    assert bucket_size(node.store).chunk_objects == 6


def test_unreachable_store_is_reported_not_raised(node: Node, tmp_path: Path) -> None:
    from kvstore.stores.s3 import S3Options, S3Store

    dead = S3Store(
        "nobucket", endpoint="http://127.0.0.1:9", access_key="a", secret_key="b",
        options=S3Options(connect_timeout=0.2, retries=0),
    )  # fmt: skip
    node.store, real = dead, node.store
    try:
        stats = node_stats(node)
    finally:
        node.store = real
        dead.close()
    assert stats["store"]["reachable"] is False and "error" in stats["store"]
    assert "error" in stats["bucket"] and "error" in stats["pins"] and stats["last_gc"] is None
    assert stats["nvme"]["entries"] == 0


def test_every_region_is_reported(
    s3_server: Any, s3_store: Any, open_test_node: Callable[..., Node], tmp_path: Path
) -> None:
    from kvstore.chunk import encode

    far = f"{s3_store.prefix}-far"
    node = open_test_node(
        s3_server,
        [f"s3://{s3_store.bucket}/{s3_store.prefix}", {"url": f"s3://{s3_store.bucket}/{far}", "name": "eu"},
         {"url": "s3://nobucket/x", "name": "gone", "endpoint": "http://127.0.0.1:9"}],
        remote_timeout_s=10.0,  # "eu" must answer on a loaded machine; "gone" is refused at once
    )  # fmt: skip
    [key] = chunk_keys(NS, list(range(16)))
    with s3_server.store(s3_store.bucket, far) as remote:
        remote.put(key, encode(key, bytes(1000)).to_bytes())
    assert load(node.engine, [key], size=1000) == [bytes(1000)]  # served by "eu", then copied home

    regions = {r["name"]: r for r in node_stats(node, scan_bucket=False)["regions"]}
    assert list(regions) == ["local", "eu", "gone"]
    assert regions["local"]["local"] is True and regions["local"]["reachable"] is True
    assert regions["eu"]["url"] == f"s3://{s3_store.bucket}/{far}"
    assert regions["eu"]["hits"] == 1 and regions["eu"]["reachable"] is True
    assert regions["gone"]["reachable"] is False and "127.0.0.1:9" in regions["gone"]["error"]
    json.dumps(regions)


@pytest.mark.slow
def test_stats_are_the_nodes_not_the_tools(
    s3_server: Any, s3_store: Any, open_test_node: Callable[..., Node], tmp_path: Path
) -> None:
    """Every process on a node adds its figures to the cache index: a second engine on the same cache (as a
    vLLM tier beside the admin service would be) and a fresh `kvstore stats` see the first one's lookups."""
    import subprocess
    import sys

    url = f"s3://{s3_store.bucket}/{s3_store.prefix}"
    first = open_test_node(s3_server, url, cache_bytes=16 << 20)
    keys = chunk_keys(NS, list(range(64)))
    first.engine.store_many([(k, bytes(1000)) for k in keys])
    first.engine.lookup(keys, wait=True)  # 4 NVMe hits
    first.engine.publish_counters()
    second = open_test_node(s3_server, url, cache_bytes=16 << 20, cache_dir=first.settings.cache_dir)
    second.engine.lookup(keys[:2], wait=True)
    second.engine.publish_counters()  # to the node agent, which the first node hosts

    def nvme_hits() -> int:
        return int(node_stats(second, scan_bucket=False)["tiers"]["nvme"]["hits"])

    wait_for(lambda: nvme_hits() == 6, what="both engines' figures in the node's counters")

    env = {
        **os.environ,
        "KVSTORE_STORE_URL": url,
        "KVSTORE_S3_ENDPOINT": s3_server.endpoint,
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "KVSTORE_CACHE_DIR": str(first.settings.cache_dir),
        "KVSTORE_CACHE_BYTES": str(16 << 20),
    }
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.admin.cli", "stats", "--no-scan-bucket"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tiers"]["nvme"]["hits"] == 6
