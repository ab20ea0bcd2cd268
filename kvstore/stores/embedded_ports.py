"""The ports of the embedded SeaweedFS: one per component, chosen free here, then bound by weed.

Between the choice and weed's bind, another process may take a port. The kernel hands ephemeral ports to
every outgoing connection and every bind to port 0, so the ports come from below its ephemeral range, where
only a deliberate bind lands; and a launch whose log shows a failed bind starts again on other ports
(`kvstore.stores.embedded`). CI met both: weed exiting at start on a taken filer port, and weed's admin server
failing to bind while S3 served, then weed exiting two minutes later.
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Self

__all__ = ["PORT_NAMES", "Ports", "bind_failed", "free_ports"]

PORT_NAMES = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",  # the admin server listens even with -admin.ui=false; port 0 would put its gRPC on 10000
    "admin.port.grpc",
    "metricsPort",  # Prometheus counters (requests by type and status): what benchmarks count S3 calls with
)
_LOW_PORTS = 20000  # where ports are chosen, up to the ephemeral range


@dataclass(frozen=True, slots=True)
class Ports:
    by_flag: dict[str, int]

    @classmethod
    def choose(cls, host: str) -> Self:
        return cls(dict(zip(PORT_NAMES, free_ports(host, len(PORT_NAMES)), strict=True)))

    @property
    def s3(self) -> int:
        return self.by_flag["s3.port"]

    @property
    def metrics(self) -> int:
        return self.by_flag["metricsPort"]


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports free on `host` now, below the ephemeral range where it has room."""
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


def bind_failed(log: str) -> bool:
    """Whether weed's log says it could not have a port it was given."""
    return "Port allocation failed" in log or "address already in use" in log


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default if it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
