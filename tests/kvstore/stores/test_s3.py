"""S3Store against a real server: races, credentials, missing buckets, an outage and the recovery after it."""

from __future__ import annotations

import hashlib
import os
import threading
import traceback
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from kvstore.errors import BucketNotFound, ConfigError, StoreAuthError, StoreUnavailable
from kvstore.stores import S3Options, S3Store, open_store

if TYPE_CHECKING:  # the root conftest is not importable by name under every pytest import mode
    from conftest import S3Server

pytestmark = pytest.mark.integration


@pytest.fixture
def racer(s3_server: S3Server, s3_store: S3Store) -> Iterator[S3Store]:
    """`s3_store`'s bucket and prefix, patiently: SeaweedFS answers racing create-only PUTs about a second
    apart (six took 1-3 s here, alone), and under CI's load one once ran past the default 4 s attempt."""
    patient = S3Options(read_timeout=30.0, deadline=60.0, retries=0)
    with s3_server.store(s3_store.bucket, s3_store.prefix, options=patient) as store:
        yield store


def test_concurrent_writers_of_same_key(racer: S3Store, s3_store: S3Store) -> None:
    payload = os.urandom(3 * 1024 * 1024)
    barrier = threading.Barrier(8)
    created: list[bool] = []
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        try:
            barrier.wait()
            if index % 2:
                created.append(racer.put_if_absent("same/key", payload))
            else:
                racer.put("same/key", payload)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stored = s3_store.get("same/key")
    assert stored is not None
    assert hashlib.sha256(stored).digest() == hashlib.sha256(payload).digest()
    assert created.count(True) <= 1


def test_put_if_absent_race_has_one_winner(racer: S3Store, s3_store: S3Store) -> None:
    barrier = threading.Barrier(6)
    results: list[bool] = []
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        try:
            barrier.wait()
            results.append(racer.put_if_absent("race", f"writer-{index}".encode()))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results.count(True) == 1
    assert s3_store.get("race") in {f"writer-{i}".encode() for i in range(6)}


def test_wrong_credentials(s3_server: S3Server, s3_bucket: str) -> None:
    with s3_server.store(s3_bucket, secret_key="wrong-secret-key") as store:
        with pytest.raises(StoreAuthError):
            store.check()
        with pytest.raises(StoreAuthError):
            store.get("k")
        with pytest.raises(StoreAuthError):
            store.put("k", b"x")
    with (
        s3_server.store(s3_bucket, access_key="no-such-user", secret_key="x" * 20) as store,
        pytest.raises(StoreAuthError),
    ):
        list(store.list())


def test_aws_session_token_is_sent_with_every_request(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`AWS_SESSION_TOKEN` (temporary credentials) goes with the keys; the server here knows no sessions, so
    a token it did not issue is refused, which shows it was sent. `session_token=""` sends none."""
    if s3_server.kind != "seaweedfs":
        pytest.skip(f"whether {s3_server.kind} refuses a token it did not issue is not known here")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "a-token-this-server-never-issued")
    with s3_server.store(s3_bucket) as store:
        with pytest.raises(StoreAuthError):
            store.put("k", b"x")
        with pytest.raises(StoreAuthError):
            store.check()


def test_an_explicitly_empty_session_token_sends_none(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if s3_server.kind != "seaweedfs":
        pytest.skip(f"whether {s3_server.kind} refuses a token it did not issue is not known here")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "a-token-this-server-never-issued")
    with s3_server.store(s3_bucket, session_token="") as store:  # what the embedded server's stores use
        store.check()
        store.put("k", b"x")
        assert store.get("k") == b"x"


def test_missing_bucket(s3_server: S3Server) -> None:
    bucket = f"kvt-missing-{uuid.uuid4().hex[:8]}"
    with s3_server.store(bucket) as store:
        with pytest.raises(BucketNotFound, match=bucket):
            store.check()
        with pytest.raises(BucketNotFound, match=bucket):
            store.put("k", b"x")
        with pytest.raises(BucketNotFound):
            store.get("k")
        with pytest.raises(BucketNotFound):
            list(store.list())


def test_unreachable_endpoint_fails_fast() -> None:
    # Port 9 (discard) on loopback is closed: connection refused, retried a bounded number of times.
    secret = "never-in-a-traceback-0123456789"
    with S3Store("bucket", endpoint="http://127.0.0.1:9", access_key="AKIDTEST", secret_key=secret) as store:
        with pytest.raises(StoreUnavailable, match=r"127\.0\.0\.1:9"):
            store.check()
        calls = (lambda: store.get("k"), lambda: store.put("k", b"x"), lambda: store.exists_many(["a", "b"]))
        for call in calls:
            with pytest.raises(StoreUnavailable) as caught:
                call()
            # Both clients' errors end up in logs with their causes: no credential may appear in them.
            text = "".join(traceback.format_exception(caught.value))
            assert secret not in text and "AKIDTEST" not in text


def test_secrets_stay_out_of_repr_and_url(s3_server: S3Server, s3_bucket: str) -> None:
    store = open_store(
        f"s3://{s3_bucket}/some/prefix",
        endpoint=s3_server.endpoint,
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
    )
    with store:
        assert store.url == f"s3://{s3_bucket}/some/prefix"
        assert s3_server.secret_key not in repr(store)
        assert s3_server.access_key not in repr(store)
        store.put("x", b"1")
        assert [info.key for info in store.list()] == ["x"]


def test_open_store_urls(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(ConfigError, match="bucket"):
        open_store("s3:///prefix")
    with pytest.raises(ConfigError, match="scheme"):
        open_store("ftp://host/x")
    with pytest.raises(ConfigError, match="absolute"):
        open_store("file://relative/path")
    with pytest.raises(ConfigError, match="option"):
        open_store("s3://b/p", endpoint="http://127.0.0.1:9", no_such_option=1)
    assert open_store("memory://shared") is open_store("memory://shared")
    local = open_store(f"file://{tmp_path}/store")
    local.put("k", b"v")
    assert local.get("k") == b"v"


@pytest.mark.slow
def test_outage_and_recovery(private_s3_server: S3Server) -> None:
    bucket = f"kvt-{uuid.uuid4().hex[:16]}"
    private_s3_server.client().make_bucket(bucket)  # the server and its data go away with the test
    with private_s3_server.store(bucket, "p") as store:
        store.put("kept", b"survives a restart")
        private_s3_server.stop()
        # The client's own timeouts and bounded retries must turn the outage into an error, not a hang.
        with pytest.raises(StoreUnavailable):
            store.get("kept")
        with pytest.raises(StoreUnavailable):
            store.put("new", b"x")
        with pytest.raises(StoreUnavailable):
            store.exists_many(["kept", "other"])
        with pytest.raises(StoreUnavailable):
            list(store.list())
        private_s3_server.start()
        assert store.get("kept") == b"survives a restart"
        store.put("new", b"x")
        assert store.exists_many(["kept", "new", "nope"]) == [True, True, False]
