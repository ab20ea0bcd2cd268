"""Many GETs in flight on one thread (`kvstore.stores.s3_get_many`): against the real S3 server for bytes,
request counts and connection reuse; against a scripted HTTP peer for what a real S3 does but SeaweedFS will
not do on command (closing an idle connection, answering 503 SlowDown, cutting a body short, never answering).
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvstore.errors import BucketNotFound, StoreUnavailable
from kvstore.stores import S3Store
from kvstore.stores.base import Buffer
from kvstore.stores.embedded_security import _make_certificates
from kvstore.stores.s3_get import Address, GetOptions, ObjectGetter
from kvstore.stores.s3_get_many import ManyGets
from tests.scripted_peer import ScriptedPeer, Staged, error, ok, signing_getter

if TYPE_CHECKING:  # the root conftest is not importable by name under every pytest import mode
    from conftest import S3Server

OPTIONS = GetOptions(
    connect_timeout=1.0, attempt_timeout=1.0, deadline=3.0, retries=2, backoff=0.01, backoff_max=0.05
)


def get_all(
    get_each: Callable[..., None], names: Sequence[str], *, at_once: int = 16
) -> dict[int, bytes | None]:
    """``get_each`` over ``names``, tagged by position; the bodies as bytes."""
    todo = iter(enumerate(names))
    out: dict[int, bytes | None] = {}

    def keep(i: int, blob: Buffer | None) -> None:
        out[i] = None if blob is None else bytes(blob)

    get_each(lambda: next(todo, None), keep, at_once=at_once)
    return out


@pytest.mark.integration
def test_every_size_comes_back_exact_with_one_get_each_over_kept_connections(
    s3_server: S3Server, s3_bucket: str
) -> None:
    blobs = {f"k{i}": os.urandom(n) for i, n in enumerate([0, 1, 4095, 65537, 256 << 10, (2 << 20) + 3])}
    with s3_server.store(s3_bucket) as store:
        for key, blob in blobs.items():
            store.put(key, blob)
        names = [*blobs, "absent"] * 4
        before = s3_server.requests(s3_bucket) if s3_server.seaweed is not None else None
        got = get_all(store.get_each, names, at_once=8)
        assert got == {i: blobs.get(name) for i, name in enumerate(names)}
        if before is not None:
            asked = s3_server.requests(s3_bucket) - before
            assert (asked.get, asked.get_missing) == (len(names), 4)  # one GET each, the fallback unused
        opened = len(store._getter._open)
        assert 1 <= opened <= 8
        with ThreadPoolExecutor(1) as other_thread:  # batches run on whichever io thread is free
            again = other_thread.submit(get_all, store.get_each, names, at_once=8).result()
        assert again == got
        assert len(store._getter._open) == opened  # the second call reused the first one's connections


@pytest.mark.integration
def test_next_item_is_asked_only_when_a_get_can_start(s3_store: S3Store) -> None:
    for key in "abc":
        s3_store.put(key, key.encode())
    handed: list[str] = []
    done: list[bytes] = []

    def next_item() -> tuple[int, str] | None:
        if done:  # the first answer makes the rest useless (a chain's first miss does so)
            return None
        key = "abc"[len(handed)]
        handed.append(key)
        return len(handed), key

    s3_store.get_each(next_item, lambda _, blob: done.append(bytes(blob)), at_once=1)
    assert (handed, done) == (["a"], [b"a"])


@pytest.mark.integration
def test_none_while_a_get_is_in_flight_means_none_now_and_an_answer_may_give_more(s3_store: S3Store) -> None:
    """A chain's rest waits for its first key's answer (`ChainFetch`): the call goes on to what it gives."""
    for key in "abc":
        s3_store.put(key, key.encode())
    handed: list[str] = []
    answered: list[bytes] = []

    def next_item() -> tuple[int, str] | None:
        key = "a" if not handed else "b" if answered and len(handed) == 1 else None  # "b" once "a" is back
        if key is None:
            return None
        handed.append(key)
        return len(handed), key

    s3_store.get_each(next_item, lambda _, blob: answered.append(bytes(blob)), at_once=4)
    assert answered == [b"a", b"b"]


Scripted = Callable[..., tuple[ManyGets, ScriptedPeer, list[str]]]


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    """A `ManyGets` talking to a scripted peer of its own, and the names its fallback was asked for."""
    made: list[tuple[ObjectGetter, ScriptedPeer]] = []

    def make(replies: list[bytes | Staged | None]) -> tuple[ManyGets, ScriptedPeer, list[str]]:
        server = ScriptedPeer(replies)
        getter = signing_getter(server.endpoint, OPTIONS)
        fell_back: list[str] = []

        def fallback(name: str) -> Buffer | None:
            fell_back.append(name)
            return getter.get(name, f"GET {name!r}")

        made.append((getter, server))
        return ManyGets(getter, fallback), server, fell_back

    yield make
    for getter, server in made:
        getter.close()
        server.close()


def test_answers_arrive_signed_and_a_missing_key_is_none(scripted: Scripted) -> None:
    many, server, fell_back = scripted([ok(b"abc"), error(404, "NoSuchKey"), ok(b"d" * 70000)])
    assert get_all(many.get_each, ["p/a", "p/b", "p/c"], at_once=1) == {0: b"abc", 1: None, 2: b"d" * 70000}
    assert fell_back == [] and server.connections == 1
    request = server.requests[0].decode()
    assert request.startswith("GET /bucket/p/a HTTP/1.1\r\n") and "Signature=" in request


def test_a_found_object_is_said_when_its_head_comes_before_its_body(scripted: Scripted) -> None:
    """`on_found` as soon as a 200's head is in, while the body is still coming (the peer sends the body only
    once it was called); never for a 404, nor for an answer that came whole."""
    body = b"b" * 100_000
    staged = Staged(ok(body), first=len(ok(body)) - len(body) + 10)  # the head and 10 bytes of the body
    many, _, fell_back = scripted([error(404, "NoSuchKey"), staged, ok(b"whole")])
    heard: list[str] = []

    def found(i: int) -> None:
        heard.append(f"found {i}")
        staged.gate.set()

    def answered(i: int, blob: Buffer | None) -> None:
        heard.append(f"answer {i}: {None if blob is None else len(blob)}")

    todo = iter(enumerate(["missing", "large", "small"]))
    many.get_each(lambda: next(todo, None), answered, at_once=1, on_found=found)
    assert heard == ["answer 0: None", "found 1", "answer 1: 100000", "answer 2: 5"]
    assert fell_back == []


def _staged(body: bytes) -> Staged:
    """``body``'s answer: the head and 10 bytes of it at once, the rest in four sends 20 ms apart once the
    client said it found the object."""
    return Staged(ok(body), first=len(ok(body)) - len(body) + 10, pieces=4, pause_s=0.02)


def _wake_marks(many: ManyGets, staged: list[Staged]) -> tuple[list[int], list[bytes | None]]:
    """GET the ``staged`` answers, then a small object, one at a time over one connection: the socket's
    receive low-water mark while each body was coming, and the answers."""
    marks: list[int] = []
    answers: list[bytes | None] = []

    def found(i: int) -> None:
        (sock,) = many.getter._open
        marks.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))
        staged[i].gate.set()

    todo = iter(enumerate([f"body{i}" for i in range(len(staged))] + ["small"]))
    many.get_each(
        lambda: next(todo, None),
        lambda _i, blob: answers.append(None if blob is None else bytes(blob)),
        at_once=1,
        on_found=found,
    )
    return marks, answers


BODIES = [os.urandom((1 << 20) + 7), os.urandom(100_000)]


def test_a_body_wakes_the_loop_in_large_pieces_and_at_its_last_bytes(scripted: Scripted) -> None:
    """While a body comes the socket reports ready only once 512 KiB more of it are in, or all it still owes
    (2-3 reads for 2 MiB, not 10-16); never more than it owes, or its last bytes would never wake the loop;
    back at one byte for the next answer's head, or that would wait for its deadline."""
    staged = [_staged(body) for body in BODIES]
    many, _, fell_back = scripted([*staged, ok(b"small")])
    marks, answers = _wake_marks(many, staged)
    assert answers == [*BODIES, b"small"]
    assert marks[0] == 512 << 10 and marks[1] in (len(BODIES[1]) - 10, len(BODIES[1]))  # (10 bytes came)
    (idle,) = many._idle
    assert idle.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    assert fell_back == []


def test_over_tls_the_mark_leaves_room_for_a_record_openssl_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _make_certificates(tmp_path)
    serving = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    serving.load_cert_chain(tmp_path / "weed.crt", tmp_path / "weed.key")
    staged = [_staged(body) for body in BODIES]
    server = ScriptedPeer([*staged, ok(b"small")], tls=serving)
    getter = signing_getter(server.endpoint, OPTIONS)
    monkeypatch.setattr(getter, "_tls_context", ssl.create_default_context(cafile=tmp_path / "ca.crt"))
    try:
        many = ManyGets(getter, lambda name: pytest.fail(f"{name} asked of the fallback"))
        marks, answers = _wake_marks(many, staged)
        assert answers == [*BODIES, b"small"]
        owed = (len(BODIES[1]) - 10, len(BODIES[1]))
        assert marks[0] == 512 << 10 and marks[1] in tuple(n - (17 << 10) for n in owed)
    finally:
        getter.close()
        server.close()


def test_an_idle_connection_the_server_closed_is_opened_again_not_asked_of_the_fallback(
    scripted: Scripted,
) -> None:
    many, server, fell_back = scripted([ok(b"one"), None, ok(b"two")])
    assert get_all(many.get_each, ["a"]) == {0: b"one"}
    assert get_all(many.get_each, ["b"]) == {0: b"two"}
    assert fell_back == [] and server.connections == 2


def test_an_error_answer_goes_to_the_blocking_client_which_retries_it(scripted: Scripted) -> None:
    many, _, fell_back = scripted([error(503, "SlowDown"), error(503, "SlowDown"), ok(b"late")])
    assert get_all(many.get_each, ["a"]) == {0: b"late"}
    assert fell_back == ["a"]


def test_no_such_bucket_is_not_a_missing_key(scripted: Scripted) -> None:
    many, _, _ = scripted([error(404, "NoSuchBucket"), error(404, "NoSuchBucket")])
    with pytest.raises(BucketNotFound):
        get_all(many.get_each, ["a"])


def test_a_body_cut_short_is_never_handed_out(scripted: Scripted) -> None:
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nConnection: close\r\n\r\n" + b"x" * 10
    many, _, fell_back = scripted([cut] * 4)
    with pytest.raises(StoreUnavailable, match="10 of 100"):
        get_all(many.get_each, ["a"])
    assert fell_back == ["a"]


def test_a_server_that_never_answers_ends_the_call_at_the_deadline() -> None:
    # The kernel accepts the connection and takes the request; nobody ever reads it.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        getter = ObjectGetter(
            "bucket",
            endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}",
            access_key=None,
            secret_key=None,
            session_token=None,
            region="us-east-1",
            options=OPTIONS,
        )
        many = ManyGets(getter, lambda name: pytest.fail("nothing failed: no fallback"))
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="no answer in time"):
            get_all(many.get_each, ["a", "b"])
        assert time.monotonic() - started < OPTIONS.attempt_timeout + 2  # bounded, not a timing check
        getter.close()


@pytest.mark.integration
def test_a_new_nodes_connections_are_opened_together_on_the_calling_thread(
    s3_store: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Against a remote endpoint each opening is a round trip or more: sixteen in a row would delay the first
    # GETs of a new node by as many. So every connection is under way before the first one is finished.
    for i in range(8):
        s3_store.put(f"k{i}", bytes([i]) * 100)
    getter = s3_store._getter
    steps: list[tuple[str, str]] = []
    real_started, real_connected = getter.connect_nowait, getter.connected

    def started() -> tuple[socket.socket, Address]:
        steps.append(("started", threading.current_thread().name))
        return real_started()

    def connected(sock: socket.socket, address: Address) -> socket.socket:
        steps.append(("connected", threading.current_thread().name))
        return real_connected(sock, address)

    monkeypatch.setattr(getter, "connect_nowait", started)
    monkeypatch.setattr(getter, "connected", connected)
    monkeypatch.setattr(getter, "connect", lambda deadline: pytest.fail("a blocking connect"))
    got = get_all(s3_store.get_each, [f"k{i}" for i in range(8)], at_once=8)
    assert got == {i: bytes([i]) * 100 for i in range(8)}
    assert [step for step, _ in steps] == ["started"] * 8 + ["connected"] * 8
    assert {thread for _, thread in steps} == {threading.current_thread().name}


def test_connections_open_over_tls_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _make_certificates(tmp_path)  # a private CA, and a certificate for 127.0.0.1 it signs
    serving = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    serving.load_cert_chain(tmp_path / "weed.crt", tmp_path / "weed.key")
    # The peer takes one connection at a time: the second handshake waits until the first answer is out.
    replies: list[bytes | None] = [ok(b"one", "Connection: close"), ok(b"two", "Connection: close")]
    server = ScriptedPeer(replies, tls=serving)
    getter = signing_getter(server.endpoint, OPTIONS)
    monkeypatch.setattr(getter, "_tls_context", ssl.create_default_context(cafile=tmp_path / "ca.crt"))
    monkeypatch.setattr(getter, "connect", lambda deadline: pytest.fail("a blocking connect"))
    try:
        many = ManyGets(getter, lambda name: pytest.fail(f"{name} asked of the fallback"))
        assert get_all(many.get_each, ["a", "b"], at_once=2) == {0: b"one", 1: b"two"}
        assert server.connections == 2
        assert all(request.startswith(b"GET /bucket/") for request in server.requests)
    finally:
        getter.close()
        server.close()


def test_a_refused_connection_goes_to_the_blocking_client(scripted: Scripted) -> None:
    many, server, fell_back = scripted([ok(b"served")])
    with socket.create_server(("127.0.0.1", 0)) as closed:
        refusing = closed.getsockname()
    many.getter._resolved = (float("inf"), [(socket.AF_INET, socket.SOCK_STREAM, 6, "", refusing)])
    assert get_all(many.get_each, ["a"]) == {0: b"served"}  # the fallback connects on its own
    assert fell_back == ["a"] and server.connections == 1


def test_after_a_refused_address_the_next_connection_tries_the_next_one(scripted: Scripted) -> None:
    many, server, fell_back = scripted([ok(b"one"), ok(b"two")])
    with socket.create_server(("127.0.0.1", 0)) as closed:
        refusing = closed.getsockname()
    listening = ("127.0.0.1", int(server.endpoint.rsplit(":", 1)[1]))
    many.getter._resolved = (
        float("inf"),
        [(socket.AF_INET, socket.SOCK_STREAM, 6, "", address) for address in (refusing, listening)],
    )
    assert get_all(many.get_each, ["a"]) == {0: b"one"}
    assert fell_back == ["a"]
    many.getter.close()  # no idle connection left: the next GET opens one
    assert get_all(many.get_each, ["b"]) == {0: b"two"}
    assert fell_back == ["a"]  # the loop connected to the address that answers


def test_a_connection_that_takes_too_long_to_open_goes_to_the_blocking_client_and_the_next_address() -> None:
    # A listener whose backlog is full drops further SYNs: a connection to it stays pending, as to an
    # address that is unreachable (a dual-stack name whose IPv6 route goes nowhere).
    server = ScriptedPeer([ok(b"one"), ok(b"two")])
    options = GetOptions(
        connect_timeout=0.2, attempt_timeout=30.0, deadline=60.0, retries=1, backoff=0.01, backoff_max=0.05
    )
    getter = signing_getter(server.endpoint, options)
    fell_back: list[str] = []

    def fallback(name: str) -> Buffer | None:
        fell_back.append(name)
        return getter.get(name, f"GET {name!r}")

    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        filler = socket.create_connection(full.getsockname())  # takes the one place in its backlog
        listening = ("127.0.0.1", int(server.endpoint.rsplit(":", 1)[1]))
        getter._resolved = (
            float("inf"),
            [(socket.AF_INET, socket.SOCK_STREAM, 6, "", at) for at in (full.getsockname(), listening)],
        )
        try:
            many = ManyGets(getter, fallback)
            began = time.monotonic()
            assert get_all(many.get_each, ["a"]) == {0: b"one"}
            # Given up at its connect timeout (0.2 s), not when the GET's attempt is due (30 s).
            assert time.monotonic() - began < 15
            assert fell_back == ["a"]
            getter.close()
            assert get_all(many.get_each, ["b"]) == {0: b"two"}
            assert fell_back == ["a"]  # the loop went to the address that answers
        finally:
            filler.close()
            getter.close()
            server.close()
