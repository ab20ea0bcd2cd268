"""The data path's own GET client (`kvstore.stores.s3_get`): against the real S3 server for bytes, signing and
connection reuse; against a scripted HTTP peer for what a real S3 does but SeaweedFS will not do on command
(closing an idle connection, answering 503 SlowDown, cutting a body short, answering chunked)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest

from kvstore.errors import StoreAuthError, StoreError, StoreUnavailable
from kvstore.stores import S3Store
from kvstore.stores.s3_get import MAX_OBJECT_BYTES, GetOptions, ObjectGetter, Unsupported
from tests.scripted_peer import ScriptedPeer, error, ok, signing_getter

if TYPE_CHECKING:  # the root conftest is not importable by name under every pytest import mode
    from conftest import S3Server

OPTIONS = GetOptions(
    connect_timeout=1.0, attempt_timeout=2.0, deadline=4.0, retries=2, backoff=0.01, backoff_max=0.05
)


@pytest.mark.integration
def test_every_size_comes_back_exact_from_many_threads_over_few_connections(s3_store: S3Store) -> None:
    blobs = {
        f"k{i}": os.urandom(size) for i, size in enumerate([0, 1, 4095, 65537, 256 << 10, (2 << 20) + 3])
    }
    for key, blob in blobs.items():
        s3_store.put(key, blob)
    keys = list(blobs) * 8
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(s3_store.get_chunk, keys))
    assert [bytes(b) for b in got if b is not None] == [blobs[k] for k in keys]
    assert s3_store.get_chunk("absent") is None
    # Kept alive: one connection per thread (the pool's four and this one), not one per GET.
    assert len(s3_store._getter._open) <= 5


@pytest.mark.integration
def test_a_session_token_is_signed_and_sent_with_a_get(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if s3_server.kind != "seaweedfs":
        pytest.skip(f"whether {s3_server.kind} refuses a token it did not issue is not known here")
    with s3_server.store(s3_bucket, session_token="") as store:
        store.put("k", b"x")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "a-token-this-server-never-issued")
    with s3_server.store(s3_bucket) as store, pytest.raises(StoreAuthError):
        store.get("k")


Scripted = Callable[..., tuple[ObjectGetter, ScriptedPeer]]


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    """A getter talking to a scripted peer of its own."""
    made: list[tuple[ObjectGetter, ScriptedPeer]] = []

    def make(replies: list[bytes | None], options: GetOptions = OPTIONS) -> tuple[ObjectGetter, ScriptedPeer]:
        server = ScriptedPeer(replies)
        getter = signing_getter(server.endpoint, options)
        made.append((getter, server))
        return getter, server

    yield make
    for getter, server in made:
        getter.close()
        server.close()


def test_a_request_is_signed_path_style(scripted: Scripted) -> None:
    # The second answer's head spans several reads.
    getter, server = scripted([ok(b"abc"), ok(b"def" * 5000, "x-amz-meta-pad: " + "p" * 9000)])
    assert getter.get("p/key", "GET") == b"abc"
    assert getter.get("p/other", "GET") == b"def" * 5000
    request = server.requests[0].decode()
    assert request.startswith("GET /bucket/p/key HTTP/1.1\r\n")
    assert "Credential=AKIDTEST/" in request and "Signature=" in request and "secret" not in request


def test_an_idle_connection_the_server_closed_is_opened_again(scripted: Scripted) -> None:
    # The first answer keeps the connection; the server then drops it unanswered, as S3 does with idle ones.
    # No retries: reopening such a connection is not a retry of a failing store.
    no_retry = GetOptions(
        connect_timeout=1.0, attempt_timeout=2.0, deadline=4.0, retries=0, backoff=0.01, backoff_max=0.05
    )
    getter, server = scripted([ok(b"one"), None, ok(b"two")], no_retry)
    assert getter.get("a", "GET") == b"one"
    assert getter.get("b", "GET") == b"two"
    assert server.connections == 2


def test_slow_down_is_retried_and_a_missing_key_is_none(scripted: Scripted) -> None:
    getter, _ = scripted(
        [error(503, "SlowDown"), error(503, "SlowDown"), ok(b"late"), error(404, "NoSuchKey")]
    )
    assert getter.get("a", "GET") == b"late"
    assert getter.get("b", "GET") is None


def test_a_body_cut_short_is_never_returned(scripted: Scripted) -> None:
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nConnection: close\r\n\r\n" + b"x" * 10
    getter, _ = scripted([cut, cut, cut])
    with pytest.raises(StoreUnavailable, match="10 of 100"):
        getter.get("a", "GET")


def test_answers_it_cannot_read_or_must_not_allocate_are_refused(scripted: Scripted) -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    huge = f"HTTP/1.1 200 OK\r\nContent-Length: {MAX_OBJECT_BYTES + 1}\r\n\r\n".encode()
    getter, _ = scripted([chunked, huge, error(400, "InvalidRequest"), error(403, "AccessDenied")])
    with pytest.raises(Unsupported):
        getter.get("a", "GET")
    with pytest.raises(StoreError, match="over"):
        getter.get("b", "GET")
    with pytest.raises(StoreError, match="400 InvalidRequest"):
        getter.get("c", "GET")
    with pytest.raises(StoreAuthError, match="AccessDenied"):
        getter.get("d", "GET")
