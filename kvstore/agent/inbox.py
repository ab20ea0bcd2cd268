"""The agent's side of the hint protocol (`kvstore.node.hints`): `HintInbox`, the bound socket.

Anything on the node that can reach the socket may write to it: a datagram that is not a hint, or a hint
with keys the index cannot hold or counters engines do not publish, is refused (what is usable in it is
kept) and counted in `rejected`; nothing a datagram holds can stop the agent.
"""

from __future__ import annotations

import contextlib
import os
import socket

from kvstore.node.hints import MAX_DATAGRAM, Hints, SocketAddress, decode, screen
from kvstore.node.private import tighten

_RECEIVE_BUFFER = 4 << 20
_BURST = 1024  # datagrams read per call at most


class HintInbox:
    """The bound socket, read with a timeout."""

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self._address = SocketAddress(cache_dir)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # Room for the bursts of a busy node while this idle-priority process waits for a core (the kernel
        # caps it at net.core.rmem_max).
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)
        self._address.bind(self._sock)
        tighten(self._address.path)  # engines run as the cache's owner; nobody else may write hints
        self.rejected = 0  # datagrams refused in whole or in part

    def receive(self, timeout: float) -> list[Hints]:
        """Whatever arrived within ``timeout`` (waiting for the first datagram only), screened."""
        self._sock.settimeout(timeout)
        try:
            first = self._sock.recv(MAX_DATAGRAM + 1)
        except TimeoutError:
            return []
        except OSError:
            return []  # closed under us: the agent is stopping
        self._sock.setblocking(False)
        datagrams = [first]
        with contextlib.suppress(BlockingIOError, OSError):
            while len(datagrams) < _BURST:
                datagrams.append(self._sock.recv(MAX_DATAGRAM + 1))
        out: list[Hints] = []
        for datagram in datagrams:
            # One byte more than a hint may hold: a longer datagram arrives cut, and is refused whole.
            hints = decode(datagram) if len(datagram) <= MAX_DATAGRAM else None
            if hints is None:
                self.rejected += 1
                continue
            screened = screen(hints)
            self.rejected += screened.refused
            out.append(screened.hints)
        return out

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._address.path)
        self._address.close()
