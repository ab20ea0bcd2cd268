"""The embedded SeaweedFS default: persistent private credentials, a ready bucket, restarts that keep data."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import pytest

from kvstore.embedded import SeaweedServer, ensure_embedded_server
from kvstore.errors import StoreAuthError
from kvstore.stores import S3Store

pytestmark = pytest.mark.integration


def litter() -> set[Path]:
    """What weed would leave in /tmp: local gRPC sockets and glog files."""
    tmp = Path("/tmp")
    return set(tmp.glob("seaweedfs-*.sock")) | set(tmp.glob("weed.*"))


def test_credentials_persist_with_0600_and_are_reused(tmp_path: Path) -> None:
    data_dir = tmp_path / "embedded"
    before = litter()
    server = ensure_embedded_server(data_dir, bucket="kvb")
    try:
        creds_file = data_dir / "credentials.json"
        assert stat.S_IMODE(creds_file.stat().st_mode) == 0o600
        saved = json.loads(creds_file.read_text())
        assert (saved["access_key"], saved["secret_key"]) == (server.access_key, server.secret_key)
        assert server.start_seconds is not None
        assert (data_dir / "weed.log").is_file()
        with S3Store(
            "kvb", endpoint=server.endpoint, access_key=server.access_key, secret_key=server.secret_key
        ) as store:
            store.check()
            store.put("k", b"persisted")
        with (
            S3Store(
                "kvb", endpoint=server.endpoint, access_key=server.access_key, secret_key="not-the-secret"
            ) as store,
            pytest.raises(StoreAuthError),
        ):
            store.check()
    finally:
        server.stop()

    again = ensure_embedded_server(data_dir, bucket="kvb")
    try:
        assert (again.access_key, again.secret_key) == (saved["access_key"], saved["secret_key"])
        with S3Store(
            "kvb", endpoint=again.endpoint, access_key=again.access_key, secret_key=again.secret_key
        ) as store:
            assert store.get("k") == b"persisted"
    finally:
        again.stop()
    assert litter() <= before  # its sockets and logs went with it (the log is weed.log in the data dir)


def test_a_running_embedded_server_is_shared_not_started_twice(tmp_path: Path) -> None:
    data_dir = tmp_path / "embedded"
    owner = ensure_embedded_server(data_dir, bucket="kvb")
    try:
        shared = ensure_embedded_server(data_dir, bucket="kvb")
        assert owner.owned and not shared.owned
        assert shared.endpoint == owner.endpoint
        shared.stop()  # a sharer's stop leaves the owner's server serving
        with S3Store(
            "kvb", endpoint=owner.endpoint, access_key=owner.access_key, secret_key=owner.secret_key
        ) as store:
            store.put("k", b"still up")
            assert store.get("k") == b"still up"
    finally:
        owner.stop()
    # The owner is gone: the next caller starts (and owns) a fresh server on the same data.
    fresh = ensure_embedded_server(data_dir, bucket="kvb")
    try:
        assert fresh.owned and fresh.running
        with S3Store(
            "kvb", endpoint=fresh.endpoint, access_key=fresh.access_key, secret_key=fresh.secret_key
        ) as store:
            assert store.get("k") == b"still up"
    finally:
        fresh.stop()


def test_restart_keeps_ports_and_data(tmp_path: Path) -> None:
    with SeaweedServer(tmp_path / "sw") as server:
        endpoint = server.endpoint
        with S3Store(
            "rb1", endpoint=endpoint, access_key=server.access_key, secret_key=server.secret_key
        ) as store:
            store.create_bucket()
            store.put("a", b"1")
            server.restart()
            assert server.endpoint == endpoint
            assert store.get("a") == b"1"


def test_space_of_deleted_objects_is_reclaimed_at_the_next_start(tmp_path: Path) -> None:
    data_dir = tmp_path / "embedded"

    def volume_bytes() -> int:
        return sum(f.stat().st_size for f in (data_dir / "weed").glob("*.dat"))

    server = ensure_embedded_server(data_dir, bucket="kvb")
    keys = [f"bench/{i}" for i in range(24)]
    try:
        with S3Store(
            "kvb", endpoint=server.endpoint, access_key=server.access_key, secret_key=server.secret_key
        ) as store:
            for key in keys:
                store.put(key, bytes(1 << 20))
            store.put("kept", b"live data survives the compaction")
            store.delete_many(keys)  # what a benchmark or GC does at its end
    finally:
        server.stop()
    assert volume_bytes() >= 24 << 20  # deleting only marks the space

    again = ensure_embedded_server(data_dir, bucket="kvb")
    try:
        deadline = time.monotonic() + 30
        while volume_bytes() >= 8 << 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert volume_bytes() < 8 << 20
        with S3Store(
            "kvb", endpoint=again.endpoint, access_key=again.access_key, secret_key=again.secret_key
        ) as store:
            assert store.get("kept") == b"live data survives the compaction"
            assert store.get(keys[0]) is None
    finally:
        again.stop()
