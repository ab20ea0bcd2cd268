"""The ports of the embedded SeaweedFS: one per component, chosen free (`kvstore.ports`), then bound by weed.

A port can still be taken between the choice and weed's bind, and weed's log says so: at start ("Port
allocation failed", it exits at once), or later for one of its parts ("address already in use": CI met its
admin server failing while S3 served, and weed exiting two minutes later). A launch whose log says either
starts again on other ports (`kvstore.stores.embedded`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from kvstore.ports import free_ports

__all__ = ["PORT_NAMES", "Ports", "bind_failed"]

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


@dataclass(frozen=True, slots=True)
class Ports:
    by_flag: dict[str, int]

    @classmethod
    def choose(cls, host: str) -> Self:
        return cls(dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES), host), strict=True)))

    @property
    def s3(self) -> int:
        return self.by_flag["s3.port"]

    @property
    def metrics(self) -> int:
        return self.by_flag["metricsPort"]


def bind_failed(log: str) -> bool:
    """Whether weed's log says it could not have a port it was given."""
    return "Port allocation failed" in log or "address already in use" in log
