"""Many whole-object GETs in flight on one thread: non-blocking keep-alive connections and one epoll.

A new node's probe GETs dozens of chunks at once. On threads (one blocking GET each, 16 of them) every GET
costs a sleep and a wake-up per `recv`, a `poll` before each `recv` (how Python keeps a socket timeout) and a
GIL hand-off on each side of both, which on this repository's bench machine (loopback SeaweedFS, 16 GETs in
flight, research run of 2026-12-05) came to 240-280 µs of process CPU per 4 KiB GET and 390-420 µs per
256 KiB GET. One thread that waits on all its connections at once, and reads each until it has nothing more,
wakes once for whatever arrived: 65-75 µs and 140-220 µs, and the GETs ended sooner (one in 210-290 µs against
320-400, and 420-470 against 580-710).

The happy path is all this loop speaks: a 200 with Content-Length (the body read straight into a 4 KiB-aligned
buffer of its own, as `ObjectGetter` does), or a 404. Anything else (an error status, an answer without
Content-Length, a connection that fails mid-answer) leaves the loop for that one object: its connection is
dropped and the object is asked once more through ``fallback``, the blocking client with the data path's
retries and error translation. A connection that was idle and is found closed before any answer is opened
again and the GET sent again, as every HTTP client does. Each GET's attempt is bounded as `ObjectGetter`'s
is; one that passes its deadline ends the call with `StoreUnavailable`.

A new node has no connection yet: the loop opens the ones it lacks itself, all at once and none blocking
(connect, then on TLS the handshake, each step taken when the socket is ready), so the first GETs go out after
one round trip, not after sixteen one after another. Research, 2026-12-06 (loopback, 16 connections): 40-53
µs of CPU and 0.6-0.9 ms a round so, against 100-120 µs and 3.6-6.6 ms through blocking connects on eight
threads, as this loop opened them before.

While a body comes in, its socket reports ready only once `_WAKE_BYTES` more of it are in, or the rest of it
(the socket's receive low-water mark, ``SO_RCVLOWAT``, which epoll honours); read as soon as anything came,
a 2 MiB body took 10-16 reads, each waking the loop and sending the server a window update. Research,
2026-12-07 (64 GETs of 2 MiB, 16 in flight, the server on a core of its own): 2-3 reads a body, 409-707 µs
of CPU a GET against 625-811, and no slower. The mark never asks for more than the body still owes, or the
last bytes would never wake the loop; over TLS a record's worth less, as OpenSSL may hold part of one. It is
back at one byte before the connection waits for its next answer's head.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from kvstore.errors import StoreError, StoreUnavailable
from kvstore.stores.base import Buffer
from kvstore.stores.buffers import aligned_buffer
from kvstore.stores.s3_get import MAX_OBJECT_BYTES, Address, ObjectGetter, parse_head

__all__ = ["ManyGets"]

_T = TypeVar("_T")

_HEAD_READ = 4096
_MAX_HEAD_BYTES = 64 << 10
_MAX_MISSING_BODY = 64 << 10  # a 404's XML error document
_MAX_IDLE = 64  # kept-alive connections between calls, for every thread of the process together
_WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError)
_WAKE_BYTES = 512 << 10  # a body's bytes are read in pieces of this much, or what is left of it
_TLS_RECORD = 17 << 10  # the most ciphertext of one TLS record (16 KiB of data and its overhead)
# What a connection waits for: its opening (TCP, then TLS), then its answer.
_CONNECTING, _HANDSHAKING, _ANSWERING = 0, 1, 2


class _Failed(Exception):
    """This connection cannot finish this answer; ``before_answer``: no byte of it came."""

    def __init__(self, before_answer: bool) -> None:
        super().__init__()
        self.before_answer = before_answer


class _Connection(Generic[_T]):
    """One non-blocking connection and the answer it is reading."""

    __slots__ = (
        "address",
        "body",
        "deadline",
        "filled",
        "got",
        "head",
        "keep",
        "length",
        "low_water",
        "name",
        "opening_until",
        "request",
        "reused",
        "sock",
        "stage",
        "status",
        "tag",
    )

    def __init__(
        self, sock: socket.socket, *, stage: int = _ANSWERING, address: Address | None = None
    ) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.stage = stage
        self.address = address  # where a connection being opened goes
        self.head = bytearray(_MAX_HEAD_BYTES)
        self.reused = False
        self.tag: _T
        self.name = ""
        self.request = b""
        self.deadline = 0.0
        self.opening_until = 0.0  # a connection still being opened then is given up (`connect_timeout`)
        self.low_water = 1  # the socket's SO_RCVLOWAT
        self._reset()

    def _reset(self) -> None:
        self.got = self.filled = self.status = 0
        self.length = -1  # the head is not read yet
        self.body: memoryview | None = None
        self.keep = True

    def send(self, tag: _T, name: str, request: bytes, deadline: float) -> None:
        """Send the GET of ``name`` (on an open connection; one being opened sends it once open)."""
        self.tag, self.name, self.request, self.deadline = tag, name, request, deadline
        self._reset()
        if self.stage != _ANSWERING:
            return
        try:
            sent = self.sock.send(request)  # a few hundred bytes into an empty send buffer
        except OSError:
            raise _Failed(before_answer=True) from None
        if sent != len(request):
            raise _Failed(before_answer=False)  # part of a request is on the wire: the connection is spoilt

    def open_further(self, getter: ObjectGetter) -> int:
        """The next step of opening this connection, its socket ready for it; then the epoll events it
        waits for (EPOLLIN for the answer once its request is sent). `_Failed` if it cannot open."""
        try:
            if self.stage == _CONNECTING:
                assert self.address is not None
                self.sock = getter.connected(self.sock, self.address)
                self.stage = _HANDSHAKING if isinstance(self.sock, ssl.SSLSocket) else _ANSWERING
            if self.stage == _HANDSHAKING:
                assert isinstance(self.sock, ssl.SSLSocket)
                try:
                    self.sock.do_handshake()
                except ssl.SSLWantReadError:
                    return select.EPOLLIN
                except ssl.SSLWantWriteError:
                    return select.EPOLLOUT
                self.stage = _ANSWERING
        except OSError:  # refused, reset, TLS refused (the blocking client says which)
            raise _Failed(before_answer=True) from None
        self.send(self.tag, self.name, self.request, self.deadline)
        return select.EPOLLIN

    def read(self, getter: ObjectGetter) -> bool:
        """Read what has arrived; True once the whole answer is in."""
        try:
            while self.length < 0:
                if not self._read_head(getter.where):
                    return False
            assert self.body is not None
            while self.filled < self.length:
                try:
                    n = self.sock.recv_into(self.body[self.filled :])
                except _WOULD_BLOCK:
                    self._wake_when(self.length - self.filled)
                    return False
                if n == 0:
                    raise _Failed(before_answer=False)
                self.filled += n
            self._wake_when(0)  # the next answer's head wakes the loop at its first byte
        except _WOULD_BLOCK:
            return False
        except (OSError, EOFError):  # reset, or TLS failing (ssl.SSLError is an OSError)
            raise _Failed(before_answer=self.got == 0) from None
        return True

    def _wake_when(self, owed: int) -> None:
        """Have the socket report ready once `_WAKE_BYTES` of the ``owed`` bytes of the body are in, or all
        of them (see the module's doc); 0: at the first byte."""
        if isinstance(self.sock, ssl.SSLSocket):
            owed -= _TLS_RECORD  # OpenSSL may have taken part of a record off the socket already
        mark = max(1, min(owed, _WAKE_BYTES))
        if mark != self.low_water:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
            self.low_water = mark

    def _read_head(self, where: str) -> bool:
        view = memoryview(self.head)
        n = self.sock.recv_into(view[self.got : self.got + _HEAD_READ])
        if n == 0:
            raise _Failed(before_answer=self.got == 0)
        self.got += n
        end = self.head.find(b"\r\n\r\n", max(0, self.got - n - 3), self.got)
        if end < 0:
            if self.got + _HEAD_READ > len(self.head):
                raise StoreError(f"{where}: answer head over {_MAX_HEAD_BYTES} bytes")
            return True
        status, length, close = parse_head(bytes(view[:end]), where)
        limit = MAX_OBJECT_BYTES if status == 200 else _MAX_MISSING_BODY
        if status not in (200, 404) or length is None or length > limit:
            raise _Failed(before_answer=False)  # the blocking client reads it and says what it means
        self.status, self.length, self.keep = status, length, not close
        self.body = aligned_buffer(length) if status == 200 else memoryview(bytearray(length))
        self.filled = min(self.got - end - 4, length)
        self.body[: self.filled] = view[end + 4 : end + 4 + self.filled]
        return True

    def answer(self) -> memoryview | None:
        """The object, None if missing. `_Failed` for a 404 that is not a missing key (no such bucket)."""
        if self.status == 200:
            return self.body
        assert self.body is not None
        if b"NoSuchBucket" in bytes(self.body):
            raise _Failed(before_answer=False)
        return None


class ManyGets:
    """GETs of whole objects through ``getter``'s endpoint and signing, many at once on the calling thread.
    Thread-safe: calls on any thread share the kept-alive connections (a batch runs on whichever io thread
    is free, and connections per thread would multiply)."""

    def __init__(
        self,
        getter: ObjectGetter,
        fallback: Callable[[str], Buffer | None],
    ) -> None:
        """``fallback`` GETs one object by name with the blocking client (retries, error translation)."""
        self.getter = getter
        self.fallback = fallback
        self._idle: list[_Connection[Any]] = []  # kept alive, no call using them; the newest last
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def get_each(
        self,
        next_item: Callable[[], tuple[_T, str] | None],
        on_object: Callable[[_T, Buffer | None], None],
        *,
        at_once: int,
        on_found: Callable[[_T], None] | None = None,
    ) -> None:
        """GET the object of every ``(tag, name)`` that ``next_item`` hands out, at most ``at_once`` in
        flight, and give each answer to ``on_object`` (None: no such object) on this thread as it completes.
        ``next_item`` is asked whenever a connection is free, so it can skip what became useless; its None
        means none now: it is asked again after the next answer, and the call returns once nothing is in
        flight and it has none. ``on_found(tag)`` as soon as an answer's head says 200 while its body is
        still coming (``next_item`` is asked again right after). Raises what the data path raises
        (`StoreUnavailable` when a GET gets no answer in time...); GETs in flight then are abandoned, their
        connections closed."""
        with _Round(self, on_object, on_found) as round_:
            while True:
                more = True
                items: list[tuple[_T, str]] = []
                while more and len(round_.busy) + len(items) < max(1, at_once):
                    item = next_item()
                    if item is None:
                        more = False
                    else:
                        items.append(item)
                for tag, name in items:
                    round_.start(tag, name)
                if not round_.busy:
                    if items:
                        continue  # the blocking client answered them: their answers may give more
                    return
                round_.wait()

    def take_idle(self) -> _Connection[Any] | None:
        """A kept-alive connection no call is using, if there is one."""
        with self._lock:
            self._forked()
            while self._idle:
                conn = self._idle.pop()
                if conn.sock.fileno() >= 0:  # else `ObjectGetter.close` closed it (the store was closed)
                    return conn
        return None

    def _forked(self) -> None:
        """In a forked child (under the lock): the parent's connections stay the parent's."""
        if self._pid != os.getpid():
            self._pid, self._idle = os.getpid(), []

    def keep(self, conn: _Connection[Any]) -> None:
        """Keep ``conn`` for the next call, on any thread (at most `_MAX_IDLE` are kept)."""
        with self._lock:
            if len(self._idle) < _MAX_IDLE and self._pid == os.getpid():
                self._idle.append(conn)
                return
        conn.sock.close()


class _Round(Generic[_T]):
    """One ``get_each`` call: its connections with a GET in flight, and the epoll that waits on them."""

    def __init__(
        self,
        owner: ManyGets,
        on_object: Callable[[_T, Buffer | None], None],
        on_found: Callable[[_T], None] | None = None,
    ) -> None:
        # In the order their GETs were sent, each due the same attempt time after: the first is due first.
        self.busy: dict[_Connection[_T], None] = {}
        self._opening: set[_Connection[_T]] = set()  # those of them still being opened
        self._watched: dict[int, _Connection[_T]] = {}  # by file descriptor, what the epoll reports
        self._epoll = select.epoll()
        self._on_found = on_found
        self._getter = owner.getter
        self._fallback = owner.fallback
        self._owner = owner
        self._on_object = on_object
        self._attempt = self._getter.options.attempt_timeout

    def __enter__(self) -> _Round[_T]:
        return self

    def __exit__(self, *exc: object) -> None:
        for conn in self.busy:  # mid-answer: no later request could be read on them
            conn.sock.close()
        self._epoll.close()

    def start(self, tag: _T, name: str, *, fresh: bool = False) -> None:
        """Send the GET of ``name`` on an idle connection (unless ``fresh``), else on a new one once it is
        open; if none takes it, the blocking client answers it now."""
        conn = self._connection(tag, name, fresh=fresh)
        if conn is None:
            self._on_object(tag, self._fallback(name))
            return
        self.busy[conn] = None
        if conn.stage == _CONNECTING:
            self._opening.add(conn)
            self._watch(conn, select.EPOLLOUT)
        else:
            self._watch(conn, select.EPOLLIN)

    def wait(self) -> None:
        """Until something arrived or a GET's deadline passed (`StoreUnavailable`); what completed goes to
        ``on_object``, and so does the blocking client's answer for a connection that took too long to open
        (its address may be unreachable where the endpoint's next one is not)."""
        now = time.monotonic()
        for slow in [c for c in self._opening if c.opening_until <= now]:
            self._give_up_opening(slow)
        if not self.busy:
            return
        first = next(iter(self.busy))
        if first.deadline <= now:
            raise StoreUnavailable(f"{self._getter.describe(f'GET {first.name!r}')}: no answer in time")
        until = min([first.deadline, *(c.opening_until for c in self._opening)])
        for fd, _ in self._epoll.poll(until - now):
            conn = self._watched.get(fd)  # (each descriptor comes once a poll: None is only defensive)
            if conn is None:
                continue
            if conn.stage != _ANSWERING:
                self._open_further(conn)
                continue
            try:
                heading = conn.length < 0
                if not conn.read(self._getter):
                    if heading and conn.status == 200 and self._on_found is not None:
                        self._on_found(conn.tag)  # found; its bytes are on their way
                    continue
                blob = conn.answer()
            except _Failed as failed:
                self._end(conn, keep=False)
                if failed.before_answer and conn.reused:  # the server closed it while idle: send again
                    self.start(conn.tag, conn.name, fresh=True)
                else:
                    self._on_object(conn.tag, self._fallback(conn.name))
                continue
            self._end(conn, keep=conn.keep)
            self._on_object(conn.tag, blob)

    def _open_further(self, conn: _Connection[_T]) -> None:
        """A connection being opened is ready for its next step (registered anew: TLS changes its socket)."""
        self._unwatch(conn)
        try:
            waits_for = conn.open_further(self._getter)
        except _Failed:
            self._forget(conn)
            conn.sock.close()
            self._on_object(conn.tag, self._fallback(conn.name))
            return
        if conn.stage == _ANSWERING:
            self._opening.discard(conn)
        self._watch(conn, waits_for)

    def _give_up_opening(self, conn: _Connection[_T]) -> None:
        self._end(conn, keep=False)
        if conn.stage == _CONNECTING and conn.address is not None:
            self._getter.demote(conn.address)
        self._on_object(conn.tag, self._fallback(conn.name))

    def _end(self, conn: _Connection[_T], *, keep: bool) -> None:
        self._unwatch(conn)
        self._forget(conn)
        if keep:
            conn.reused, conn.body = True, None
            self._owner.keep(conn)
        else:
            conn.sock.close()

    def _watch(self, conn: _Connection[_T], events: int) -> None:
        fd = conn.sock.fileno()
        self._watched[fd] = conn
        self._epoll.register(fd, events)

    def _unwatch(self, conn: _Connection[_T]) -> None:
        fd = conn.sock.fileno()
        self._epoll.unregister(fd)
        del self._watched[fd]

    def _forget(self, conn: _Connection[_T]) -> None:
        self.busy.pop(conn, None)
        self._opening.discard(conn)

    def _connection(self, tag: _T, name: str, *, fresh: bool) -> _Connection[_T] | None:
        """An idle connection with the GET of ``name`` sent, else a new one being opened that sends it once
        open; None when none could take it (the caller asks the blocking client)."""
        request = self._getter.request(name)
        deadline = time.monotonic() + self._attempt
        while not fresh and (conn := self._owner.take_idle()) is not None:
            try:
                conn.send(tag, name, request, deadline)
                return conn
            except _Failed:
                conn.sock.close()
        try:
            sock, address = self._getter.connect_nowait()
        except OSError:
            return None  # the blocking client tries (and retries) and says why it cannot
        new: _Connection[_T] = _Connection(sock, stage=_CONNECTING, address=address)
        new.send(tag, name, request, deadline)  # kept until the connection is open
        new.opening_until = min(deadline, time.monotonic() + self._getter.options.connect_timeout)
        return new
