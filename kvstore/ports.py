"""Ports for the servers this project starts on loopback (the embedded S3 server; the benchmarks' vLLM
servers and routers; the tests' servers): chosen free here, bound by the server a moment later.

In between, another process may take one. The kernel hands its ephemeral ports to every outgoing connection
and every bind to port 0, so ports are chosen below that range, where only a deliberate bind lands (CI lost a
test worker's S3 server to a port taken in between).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["LOOPBACK", "free_port", "free_ports"]

LOOPBACK = "127.0.0.1"
_LOW_PORTS = 20000  # where ports are chosen, up to the ephemeral range


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct TCP ports nobody holds on `host` now, below the ephemeral range where it has room."""
    low = _ephemeral_low()
    tries = 1000 if low - _LOW_PORTS >= 1000 else 0  # then any free port the kernel gives
    # Hold all sockets open until every port is chosen, so they are distinct.
    socks: list[socket.socket] = []
    try:
        while len(socks) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            tries -= 1
            try:
                s.bind((host, random.randrange(_LOW_PORTS, low) if tries >= 0 else 0))
            except OSError:  # taken: another one
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = LOOPBACK) -> int:
    """One TCP port nobody holds on `host` now (see `free_ports`)."""
    return free_ports(1, host)[0]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default if it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
