"""What engines tell the node agent: hints, over a Unix datagram socket in the cache directory.

Engines and the agent share the LMDB index and the upload journal; the bytes of a chunk never cross this
socket. What does is small and lossy by design: keys whose object-store hits the agent should admit to NVMe,
keys that were used (LRU order, access records for GC), and the engine's figures for the node's counters.
An engine never waits for the agent: `AgentLink` buffers hints in memory (appends only, on vLLM's threads)
and `send` ships them as a few datagrams, without blocking, from the engine's housekeeping thread. While the
agent is not there (still starting, or down) hints wait in bounded buffers; past the bound the oldest are
dropped and counted. Nothing a request needs depends on them.

Datagram format: one msgpack `Hints` per datagram, at most `_MAX_DATAGRAM` bytes. The socket lives at
``<cache_dir>/agent.sock``; a cache directory whose path is too long for a socket address is reached through
``/proc/self/fd`` instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence

import msgspec

log = logging.getLogger(__name__)

SOCKET_NAME = "agent.sock"
# The kernel queues few datagrams per socket (net.unix.max_dgram_qlen, often 10), so hints go in big ones:
# a busy node's fraction of a second of touches fits in one. Within the default send buffer (208 KiB).
_MAX_DATAGRAM = 200_000
_MAX_BUFFERED = 200_000  # keys held per kind while the agent does not take them (then the oldest go)
_SUN_PATH_MAX = 107
_RECEIVE_BUFFER = 4 << 20


class Hints(msgspec.Struct, omit_defaults=True, frozen=True):
    """One datagram from an engine. ``fetched``: verified object-store hits worth admitting to NVMe;
    ``touched``: chunks loaded or used (LRU order, access records); ``stored``: chunks just stored (access
    records, and the uploads have work); ``counters``: increments of the node's counters."""

    pid: int
    fetched: list[str] = []
    touched: list[str] = []
    stored: list[str] = []
    counters: dict[str, int] = {}


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Hints)


def decode(datagram: bytes) -> Hints | None:
    """A datagram's hints, or None if it is not one (anything may write to a socket)."""
    try:
        return _decoder.decode(datagram)
    except msgspec.DecodeError:
        return None


class AgentLink:
    """The engine's side: buffers hints (never blocks) and sends them when asked (never blocks either)."""

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self._address = SocketAddress(cache_dir)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        # Datagrams in flight are charged to the sender (the kernel caps this at net.core.wmem_max).
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _RECEIVE_BUFFER)
        self._fetched: deque[str] = deque(maxlen=_MAX_BUFFERED)
        self._touched: deque[str] = deque(maxlen=_MAX_BUFFERED)
        self._stored: deque[str] = deque(maxlen=_MAX_BUFFERED)
        self._counters: dict[str, int] = {}
        self.sent = 0
        self.dropped = 0  # keys that did not fit the buffers while the agent was away

    def fetched(self, keys: Sequence[str]) -> None:
        self._buffer(self._fetched, keys)

    def touched(self, keys: Sequence[str]) -> None:
        self._buffer(self._touched, keys)

    def stored(self, keys: Sequence[str]) -> None:
        self._buffer(self._stored, keys)

    def _buffer(self, buffered: deque[str], keys: Sequence[str]) -> None:
        self.dropped += max(0, len(buffered) + len(keys) - _MAX_BUFFERED)  # the oldest go
        buffered.extend(keys)

    def counters(self, deltas: Mapping[str, int]) -> None:
        for name, delta in deltas.items():
            if delta:
                self._counters[name] = self._counters.get(name, 0) + delta

    @property
    def pending(self) -> bool:
        return bool(self._fetched or self._touched or self._stored or self._counters)

    def send(self) -> bool:
        """Ship what is buffered; False when the agent is not there to take it (the rest stays buffered)."""
        counters, self._counters = self._counters, {}
        lists = (_drain(self._fetched), _drain(self._touched), _drain(self._stored))
        messages = list(_messages(os.getpid(), *lists, counters))
        for i, hints in enumerate(messages):
            try:
                self._address.send(self._sock, _encoder.encode(hints))
            except OSError as exc:  # no agent (ENOENT, ECONNREFUSED) or its queue is full (EAGAIN)
                log.debug("node agent not reachable (%s): hints wait", exc)
                for unsent in messages[i:]:
                    self._keep(unsent)
                return False
            self.sent += 1
        return True

    def send_within(self, seconds: float) -> bool:
        """`send`, retried until it works or `seconds` pass (an engine shutting down, its agent starting)."""
        deadline = time.monotonic() + seconds
        while not self.send():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def _keep(self, hints: Hints) -> None:
        self._buffer(self._fetched, hints.fetched)
        self._buffer(self._touched, hints.touched)
        self._buffer(self._stored, hints.stored)
        self.counters(hints.counters)

    def close(self) -> None:
        self._sock.close()
        self._address.close()


def _drain(keys: deque[str]) -> list[str]:
    out: list[str] = []
    with contextlib.suppress(IndexError):
        while True:
            out.append(keys.popleft())
    return out


def _messages(
    pid: int, fetched: list[str], touched: list[str], stored: list[str], counters: dict[str, int]
) -> Iterator[Hints]:
    """As few datagrams as the size limit allows: each carries as many keys of one kind as fit."""
    if counters:
        yield Hints(pid, counters=counters)
    longest = max(map(len, fetched + touched + stored), default=1)
    step = max(1, (_MAX_DATAGRAM - 4096) // (longest + 3))  # msgpack: a few bytes of length per key
    for start in range(0, len(fetched), step):
        yield Hints(pid, fetched=fetched[start : start + step])
    for start in range(0, len(touched), step):
        yield Hints(pid, touched=touched[start : start + step])
    for start in range(0, len(stored), step):
        yield Hints(pid, stored=stored[start : start + step])


class SocketAddress:
    """``<cache_dir>/agent.sock`` as a socket address, short enough for the kernel whatever the path."""

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self.path = os.path.join(os.fspath(cache_dir), SOCKET_NAME)
        self._dir_fd: int | None = None
        self.address = self.path
        if len(os.fsencode(self.path)) > _SUN_PATH_MAX:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._dir_fd = os.open(os.path.dirname(self.path), os.O_PATH | os.O_DIRECTORY)
            self.address = f"/proc/self/fd/{self._dir_fd}/{SOCKET_NAME}"

    def send(self, sock: socket.socket, payload: bytes) -> None:
        sock.sendto(payload, self.address)

    def bind(self, sock: socket.socket) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a dead agent's socket (the caller holds the agent lock)
        sock.bind(self.address)

    def close(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None


class HintInbox:
    """The agent's side: the bound socket, read with a timeout."""

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self._address = SocketAddress(cache_dir)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # Room for the bursts of a busy node while this idle-priority process waits for a core (the kernel
        # caps it at net.core.rmem_max).
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)
        self._address.bind(self._sock)
        os.chmod(self._address.path, 0o660)

    def receive(self, timeout: float) -> list[Hints]:
        """Whatever arrived within ``timeout`` (waiting for the first datagram only)."""
        out: list[Hints] = []
        self._sock.settimeout(timeout)
        try:
            first = self._sock.recv(_MAX_DATAGRAM + 4096)
        except TimeoutError:
            return out
        except OSError:
            return out  # closed under us: the agent is stopping
        self._sock.setblocking(False)
        datagrams = [first]
        with contextlib.suppress(BlockingIOError, OSError):
            while len(datagrams) < 1024:
                datagrams.append(self._sock.recv(_MAX_DATAGRAM + 4096))
        for datagram in datagrams:
            hints = decode(datagram)
            if hints is not None:
                out.append(hints)
        return out

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._address.path)
        self._address.close()
