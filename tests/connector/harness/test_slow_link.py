"""`SlowLink`: a proxy process that carries every byte both ways unchanged, no sooner than its round trip and
each connection's rate allow; a bad shape or upstream is refused before anything starts."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvstore.connector.harness.slow_link import LinkShape, SlowLink

_BODY = os.urandom(3 << 20)


@pytest.fixture
def upstream() -> Iterator[str]:
    """A server on loopback that answers every 4-byte request with its length in bytes of `_BODY`."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            while request := conn.recv(4):
                conn.sendall(_BODY[: int.from_bytes(request, "big")])

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def _ask(endpoint: str, sizes: list[int]) -> tuple[list[bytes], list[float]]:
    """Each size asked in turn on one connection: the answers and the seconds each took."""
    port = int(endpoint.rsplit(":", 1)[1])
    answers, seconds = [], []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        for size in sizes:
            start = time.monotonic()
            conn.sendall(size.to_bytes(4, "big"))
            got = bytearray()
            while len(got) < size:
                got += conn.recv(size - len(got))
            answers.append(bytes(got))
            seconds.append(time.monotonic() - start)
    return answers, seconds


def test_bytes_come_back_whole_after_the_round_trip_and_at_the_rate(upstream: str) -> None:
    shape = LinkShape(rtt_s=0.05, bytes_per_s=20e6)
    assert str(shape) == "50 ms round trip, 20 MB/s per connection"
    with SlowLink(upstream, shape) as link:
        assert link.endpoint != upstream
        answers, seconds = _ask(link.endpoint, [1, len(_BODY)])
    assert answers == [_BODY[:1], _BODY]
    # Lower bounds only (a loaded machine is slower, never faster): a byte waits for the round trip, and
    # 3 MiB at 20 MB/s take 157 ms more.
    assert seconds[0] >= 0.05
    assert seconds[1] >= 0.05 + len(_BODY) / 20e6


def test_the_link_process_is_gone_after_close(upstream: str) -> None:
    link = SlowLink(upstream, LinkShape(rtt_s=0.0))
    port = int(link.endpoint.rsplit(":", 1)[1])
    assert _ask(link.endpoint, [10])[0] == [_BODY[:10]]
    link.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


@pytest.mark.parametrize(
    ("rtt_s", "bytes_per_s"), [(-0.001, 1e6), (10.0, 1e6), (0.01, 0.0), (0.01, -1.0), (float("nan"), 1e6)]
)
def test_a_bad_shape_is_refused(rtt_s: float, bytes_per_s: float) -> None:
    with pytest.raises(ValueError, match="round trip"):
        LinkShape(rtt_s, bytes_per_s)


@pytest.mark.parametrize("upstream", ["https://127.0.0.1:9000", "http://127.0.0.1", "file:///tmp/x"])
def test_an_upstream_it_cannot_carry_is_refused(upstream: str) -> None:
    with pytest.raises(ValueError, match="http://host:port"):
        SlowLink(upstream, LinkShape(rtt_s=0.01))
