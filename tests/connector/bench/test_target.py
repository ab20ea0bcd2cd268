"""Where a benchmark writes: a fresh prefix of the configured store, or of the embedded server, emptied at
the end; the environment a tier in the same process reads its credentials from, restored afterwards."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kvstore.config import load_settings
from kvstore.connector.bench.target import bench_target, environment
from kvstore.connector.harness.slow_link import LinkShape
from kvstore.errors import ConfigError
from kvstore.storage import EMBEDDED_BUCKET, open_object_store
from kvstore.stores import open_store


def test_a_configured_store_gets_a_fresh_prefix_emptied_at_the_end(tmp_path: Path) -> None:
    settings = load_settings(store_url=(tmp_path / "bucket").as_uri(), data_dir=str(tmp_path / "data"))
    with open_object_store(settings)[0] as whole:
        whole.put("real/cache-data", b"never touched")
        with bench_target(settings, "unit") as target:
            assert target.store_url.startswith(f"{settings.local_store_url}/bench-unit-")
            assert not target.is_s3 and target.env == {} and target.server_pid is None
            assert target.server_dir is None  # no server of ours: nothing of it to drop from the page cache
            with open_store(target.store_url) as mine:
                mine.put("chunk", b"benchmark data")
            assert any(info.key.endswith("/chunk") for info in whole.list())
        assert [info.key for info in whole.list()] == ["real/cache-data"]


@pytest.mark.slow
def test_the_embedded_server_serves_when_nothing_is_configured_and_stops_after(tmp_path: Path) -> None:
    settings = load_settings(data_dir=str(tmp_path / "data"), store_url="")
    with bench_target(settings, "unit") as target:
        assert target.is_s3 and target.endpoint and target.server_pid is not None
        # Its objects' files, which benchmarks drop from the page cache before timing reads.
        assert target.server_dir == tmp_path / "data" / "s3"
        assert any(path.suffix == ".dat" for path in target.server_dir.rglob("*"))
        bucket, prefix = target.bucket_and_prefix
        assert bucket == EMBEDDED_BUCKET and prefix.startswith("bench-unit-")
        assert target.env == {
            "AWS_ACCESS_KEY_ID": target.access_key,
            "AWS_SECRET_ACCESS_KEY": target.secret_key,
        }
        pid = target.server_pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_link_is_refused_for_a_store_that_is_not_s3_on_plain_http(tmp_path: Path) -> None:
    settings = load_settings(store_url=(tmp_path / "bucket").as_uri(), data_dir=str(tmp_path / "data"))
    with pytest.raises(ConfigError, match="plain http"), bench_target(settings, "unit", LinkShape(0.01)):
        pass


@pytest.mark.slow
def test_every_request_goes_through_the_link_and_the_link_goes_after(tmp_path: Path) -> None:
    settings = load_settings(data_dir=str(tmp_path / "data"), store_url="")
    with bench_target(settings, "unit", LinkShape(0.02, 50e6)) as target:
        assert target.link == "20 ms round trip, 50 MB/s per connection"
        assert target.endpoint and target.endpoint.startswith("http://127.0.0.1:")
        with environment(target.env), open_store(target.store_url, endpoint=target.endpoint) as mine:
            before = target.requests()
            mine.put("chunk", b"through the link")
            assert mine.get("chunk") == b"through the link"
            after = target.requests()
        assert before is not None and after is not None  # the server counts what crossed the link
        assert ((after - before).put, (after - before).get) == (1, 1)
        port = int(target.endpoint.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_environment_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_TEST_KEPT", "before")
    monkeypatch.delenv("KVSTORE_TEST_NEW", raising=False)
    with environment({"KVSTORE_TEST_KEPT": "during", "KVSTORE_TEST_NEW": "during"}):
        assert os.environ["KVSTORE_TEST_KEPT"] == os.environ["KVSTORE_TEST_NEW"] == "during"
    assert os.environ["KVSTORE_TEST_KEPT"] == "before" and "KVSTORE_TEST_NEW" not in os.environ
