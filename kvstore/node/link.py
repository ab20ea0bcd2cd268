"""The engine's side of the hint protocol (`kvstore.node.hints`): `AgentLink`.

An engine never waits for the agent: the link buffers hints in memory (appends only, on vLLM's threads) and
`send` ships them as a few datagrams, without blocking, from the engine's housekeeping thread. While the
agent is not there (still starting, or down) hints wait in bounded buffers; past the bound the oldest are
dropped and counted, as are keys no datagram can carry. Nothing a request needs depends on them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Mapping, Sequence

from kvstore.node.hints import MAX_DATAGRAM, Hints, SocketAddress, datagrams, encode

log = logging.getLogger(__name__)

_MAX_BUFFERED = 200_000  # keys held per kind while the agent does not take them (then the oldest go)
_SEND_BUFFER = 4 << 20
# A kernel whose send buffer cannot hold a full datagram (net.core.wmem_max below ~200 KiB) answers
# EMSGSIZE: the link halves its datagrams down to this size before it gives a datagram up.
_MIN_DATAGRAM = 8192
# Errors that mean the agent is away or busy: the hints wait for it.
_AGENT_AWAY = (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.ENOBUFS)


class AgentLink:
    """Buffers hints (never blocks) and sends them when asked (never blocks either)."""

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self._address = SocketAddress(cache_dir)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        # Datagrams in flight are charged to the sender (the kernel caps this at net.core.wmem_max).
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        self._touched: deque[str] = deque(maxlen=_MAX_BUFFERED)
        self._stored: deque[str] = deque(maxlen=_MAX_BUFFERED)
        self._counters: dict[str, int] = {}
        self._limit = MAX_DATAGRAM
        self.sent = 0
        # Keys that never reach the agent: past the buffers' bound while it was away, or too long to send.
        self.dropped = 0

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
        return bool(self._touched or self._stored or self._counters)

    def send(self) -> bool:
        """Ship what is buffered; False when the agent is not there to take it (the rest stays buffered)."""
        counters, self._counters = self._counters, {}
        lists = (_drain(self._touched), _drain(self._stored))
        messages, too_long = datagrams(os.getpid(), *lists, counters, limit=self._limit)
        self.dropped += too_long
        for i, hints in enumerate(messages):
            try:
                self._address.send(self._sock, encode(hints))
            except OSError as exc:
                if exc.errno == errno.EMSGSIZE and self._limit > _MIN_DATAGRAM:
                    self._limit //= 2  # this kernel's datagrams are smaller: split finer from now on
                    log.info("hint datagrams of %d bytes from now on (%s)", self._limit, exc)
                elif exc.errno not in _AGENT_AWAY:
                    log.warning("a hint datagram could not be sent (%s): its keys are dropped", exc)
                    self.dropped += _keys(hints)
                    continue
                else:
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
        self._buffer(self._touched, hints.touched)
        self._buffer(self._stored, hints.stored)
        self.counters(hints.counters)

    def close(self) -> None:
        self._sock.close()
        self._address.close()


def _keys(hints: Hints) -> int:
    return len(hints.touched) + len(hints.stored)


def _drain(keys: deque[str]) -> list[str]:
    out: list[str] = []
    with contextlib.suppress(IndexError):
        while True:
            out.append(keys.popleft())
    return out
