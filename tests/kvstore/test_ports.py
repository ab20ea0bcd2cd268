"""Ports for local servers: free, distinct, and out of the kernel's way."""

from __future__ import annotations

import socket
from pathlib import Path

from kvstore.ports import LOOPBACK, free_port, free_ports


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(11)
    assert len(set(ports)) == 11
    # Below the range the kernel takes ports from for outgoing connections and binds to port 0, where
    # nothing takes one between this choice and the server's bind.
    assert all(1024 <= port < low for port in [*ports, free_port()])
    for port in ports:
        with socket.socket() as s:
            s.bind((LOOPBACK, port))


def test_a_held_port_is_never_chosen() -> None:
    held = [socket.socket() for _ in range(50)]
    try:
        for s in held:
            s.bind((LOOPBACK, free_port()))
        taken = {s.getsockname()[1] for s in held}
        assert len(taken) == 50
        assert not taken & set(free_ports(200))
    finally:
        for s in held:
            s.close()
