"""A scripted HTTP peer for the GET clients' tests: what a real S3 does but SeaweedFS will not do on command
(closing an idle connection, answering 503 SlowDown, cutting a body short, answering chunked). Import as
`from tests.scripted_peer import ...`."""

from __future__ import annotations

import socket
import ssl
import threading
import time

from kvstore.stores.s3_get import GetOptions, ObjectGetter


class Staged:
    """A reply in two parts: its first ``first`` bytes at once, the rest once ``gate`` is set (or in 10 s), in
    ``pieces`` sends ``pause_s`` apart."""

    def __init__(self, reply: bytes, first: int, *, pieces: int = 1, pause_s: float = 0.0) -> None:
        self.first, self.rest = reply[:first], reply[first:]
        self.gate = threading.Event()
        self.pieces, self.pause_s = pieces, pause_s

    def send_rest(self, conn: socket.socket) -> None:
        size = -(-len(self.rest) // self.pieces)
        for at in range(0, len(self.rest), size):
            if at:
                time.sleep(self.pause_s)
            conn.sendall(self.rest[at : at + size])


class ScriptedPeer:
    """A TCP server on loopback that answers each request with the next scripted reply; a reply is raw
    bytes, a `Staged` reply, or None to close the connection without answering. One connection at a time,
    in the order they came; with ``tls``, over TLS."""

    def __init__(self, replies: list[bytes | Staged | None], *, tls: ssl.SSLContext | None = None) -> None:
        self.replies = replies
        self.requests: list[bytes] = []
        self.connections = 0
        self._tls = tls
        self._listener = socket.create_server(("127.0.0.1", 0))
        scheme = "https" if tls is not None else "http"
        self.endpoint = f"{scheme}://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while self.replies:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            if self._tls is not None:
                conn.settimeout(5)
                try:
                    conn = self._tls.wrap_socket(conn, server_side=True)
                except OSError:
                    conn.close()
                    continue
            with conn:
                while self.replies:
                    request = b""
                    while b"\r\n\r\n" not in request:
                        data = conn.recv(65536)
                        if not data:
                            break
                        request += data
                    if not request:
                        break
                    self.requests.append(request)
                    reply = self.replies.pop(0)
                    if reply is None:
                        break
                    if isinstance(reply, Staged):
                        head = reply.first
                        conn.sendall(head)
                        reply.gate.wait(10)
                        reply.send_rest(conn)
                    else:
                        head = reply
                        conn.sendall(reply)
                    if b"Connection: close" in head:
                        break

    def close(self) -> None:
        self._listener.close()
        self._thread.join(5)


def ok(body: bytes, *extra: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in extra)
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{head}\r\n".encode() + body


def error(status: int, code: str) -> bytes:
    body = f"<Error><Code>{code}</Code></Error>".encode()
    return f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def signing_getter(endpoint: str, options: GetOptions) -> ObjectGetter:
    """A GET client for the bucket "bucket" at ``endpoint`` that signs with test keys."""
    return ObjectGetter(
        "bucket",
        endpoint=endpoint,
        access_key="AKIDTEST",
        secret_key="secret",
        session_token=None,
        region="us-east-1",
        options=options,
    )
