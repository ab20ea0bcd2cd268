"""The tiered engine over several regions: a remote hit is served, copied into the local region, admitted to
NVMe; a corrupt remote chunk is neither served nor copied. Real S3 (two buckets), real LMDB cache."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvstore.chunk import HEADER_BLOCK, Codec, encode
from kvstore.config import load_settings
from kvstore.engine import Presence
from kvstore.metrics import EngineMetrics
from kvstore.runtime import Node, open_node
from kvstore.stores import RegionalStore, S3Store
from tests.helpers import sample, wait_for

if TYPE_CHECKING:
    from conftest import S3Server

pytestmark = pytest.mark.integration

CHUNK = 64 * 1024


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


def chunk_key() -> str:
    return f"ns_abc_r0/{uuid.uuid4().hex[:3]}/00_g0/{uuid.uuid4().hex}.bin"


def load(node: Node, key: str) -> bytes | None:
    buf = memoryview(bytearray(CHUNK))
    [ok] = node.engine.load_into([(key, buf)])
    return bytes(buf) if ok else None


@pytest.fixture
def far_bucket(s3_server: S3Server) -> Iterator[str]:
    with s3_server.bucket() as bucket:
        yield bucket


@pytest.fixture
def local(s3_server: S3Server, s3_bucket: str) -> Iterator[S3Store]:
    with s3_server.store(s3_bucket) as store:
        yield store


@pytest.fixture
def remote(s3_server: S3Server, far_bucket: str) -> Iterator[S3Store]:
    with s3_server.store(far_bucket) as store:
        yield store


@pytest.fixture
def metrics() -> EngineMetrics:
    return EngineMetrics(CollectorRegistry())


@pytest.fixture
def node(
    s3_server: S3Server, s3_bucket: str, far_bucket: str, tmp_path: Path, metrics: EngineMetrics
) -> Iterator[Node]:
    settings = load_settings(
        store_url=[f"s3://{s3_bucket}", {"url": f"s3://{far_bucket}", "name": "eu"}],
        s3_endpoint=s3_server.endpoint,
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
        cache_dir=tmp_path / "nvme",
        cache_bytes=64 * CHUNK,
        codec="zstd",
        remote_timeout_s=10.0,
    )
    opened = open_node(settings, metrics=metrics)
    try:
        yield opened
    finally:
        opened.close()


def regional(node: Node) -> RegionalStore:
    assert isinstance(node.store, RegionalStore)
    return node.store


def test_remote_hit_is_served_then_local_then_on_nvme(
    node: Node, local: S3Store, remote: S3Store, metrics: EngineMetrics
) -> None:
    key, here = chunk_key(), chunk_key()
    remote.put(key, encode(key, payload(1), Codec.ZSTD).to_bytes())
    local.put(here, encode(here, payload(2), Codec.ZSTD).to_bytes())
    assert node.engine.lookup([key, here]) == [Presence.REMOTE, Presence.REMOTE]
    assert load(node, key) == payload(1)
    assert load(node, here) == payload(2)
    assert sample(metrics, "kvstore:region_hits_total", region="eu") == 1
    assert sample(metrics, "kvstore:region_hits_total", region="local") == 1
    # The existing per-tier metrics keep their labels: both loads were object-store loads.
    assert sample(metrics, "kvstore:read_bytes_total", tier="object") == 2 * CHUNK

    assert regional(node).wait_copies(30)
    assert local.get(key) == remote.get(key)
    assert sample(metrics, "kvstore:region_copies_total", region="eu") == 1
    wait_for(lambda: node.cache.contains_many([key]) == [True], what="admission to NVMe (in the background)")
    assert node.engine.lookup([key]) == [Presence.LOCAL]
    assert load(node, key) == payload(1)
    assert sample(metrics, "kvstore:read_bytes_total", tier="nvme") == CHUNK
    assert sample(metrics, "kvstore:region_hits_total", region="eu") == 1


def test_corrupt_remote_chunk_is_neither_served_nor_copied(
    node: Node, local: S3Store, remote: S3Store, metrics: EngineMetrics
) -> None:
    key = chunk_key()
    bad = bytearray(encode(key, payload(3)).to_bytes())
    bad[HEADER_BLOCK] ^= 0xFF
    remote.put(key, bytes(bad))
    assert load(node, key) is None
    assert sample(metrics, "kvstore:checksum_failures_total", tier="object") == 1
    assert sample(metrics, "kvstore:region_hits_total", region="eu") == 0
    assert node.engine.lookup([key]) == [Presence.MISS]
    assert regional(node).wait_copies(30)
    assert local.get(key) is None
    assert node.cache.contains_many([key]) == [False]
    assert sample(metrics, "kvstore:region_copies_total", region="eu") == 0
    assert remote.get(key) == bytes(bad)  # another region's object is never deleted from here
