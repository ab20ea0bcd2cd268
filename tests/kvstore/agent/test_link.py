"""Hints from engines to the node agent over the cache directory's datagram socket."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore.agent import link as link_module
from kvstore.agent.link import AgentLink, HintInbox, Hints, SocketAddress, decode
from kvstore.agent.node_agent import NodeAgent
from kvstore.cache import NVMeCache
from tests.helpers import wait_for


def test_hints_arrive_whole_and_in_as_few_datagrams_as_fit(tmp_path: Path) -> None:
    inbox = HintInbox(tmp_path)
    link = AgentLink(tmp_path)
    received: list[Hints] = []
    touched = [f"ns_abc_r0/{i:06d}/00_g0/{'f' * 64}.bin" for i in range(5000)]

    def receive() -> None:
        # Until the stored keys, packed last, have arrived (the touched ones alone once ended this too early).
        while len([k for h in received for k in h.stored]) < 3:
            got = inbox.receive(timeout=5)
            if not got:
                return
            received.extend(got)

    receiver = threading.Thread(target=receive)
    receiver.start()
    try:
        link.touched(touched)
        link.fetched(touched[:10])
        link.stored(touched[:3])
        link.counters({"nvme.hits": 5, "nvme.queries": 0})
        assert link.send()
        receiver.join(10)
        assert [k for h in received for k in h.touched] == touched
        assert [k for h in received for k in h.fetched] == touched[:10]
        assert [k for h in received for k in h.stored] == touched[:3]
        assert [h.counters for h in received if h.counters] == [{"nvme.hits": 5}]
        assert 1 < len(received) < 50
    finally:
        link.close()
        inbox.close()


def test_a_cache_directory_too_long_for_a_socket_address_still_works(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    assert len(str(deep / "agent.sock")) > 108
    inbox = HintInbox(deep)
    link = AgentLink(deep)
    try:
        link.touched(["k/1.bin"])
        assert link.send()
        assert [h.touched for h in inbox.receive(timeout=2)] == [["k/1.bin"]]
        assert (deep / "agent.sock").exists()
    finally:
        link.close()
        inbox.close()


def test_hints_wait_for_an_agent_that_is_not_there_yet(tmp_path: Path) -> None:
    link = AgentLink(tmp_path)
    link.touched(["a", "b"])
    link.fetched(["c"])
    link.counters({"nvme.hits": 2})
    assert not link.send()
    assert link.pending and link.dropped == 0
    inbox = HintInbox(tmp_path)  # the agent comes up
    try:
        assert link.send()
        got = inbox.receive(timeout=2)
        assert [k for h in got for k in h.touched] == ["a", "b"]
        assert [k for h in got for k in h.fetched] == ["c"]
        assert [h.counters for h in got if h.counters] == [{"nvme.hits": 2}]
    finally:
        inbox.close()
        link.close()


def test_past_their_bound_the_oldest_hints_are_dropped_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(link_module, "_MAX_BUFFERED", 3)
    link = AgentLink(tmp_path)
    link.touched(["a", "b"])
    assert not link.send()
    link.touched(["c", "d"])
    assert not link.send()
    assert link.dropped == 1
    inbox = HintInbox(tmp_path)
    try:
        assert link.send()
        assert [k for h in inbox.receive(timeout=2) for k in h.touched] == ["b", "c", "d"]
    finally:
        inbox.close()
        link.close()


def test_the_agent_ignores_what_is_not_a_hint(
    cache: NVMeCache, start_agent: Callable[..., NodeAgent]
) -> None:
    agent = start_agent(cache, None)
    address = SocketAddress(cache.directory)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        for junk in (b"", b"\x00" * 100, b"\x81\xa3pid\xa1x", b"not msgpack"):
            address.send(sock, junk)
    assert decode(b"\x81\xa3pid\xa1x") is None
    link = AgentLink(cache.directory)
    link.touched(["k/1.bin"])
    assert link.send()
    wait_for(lambda: agent.hints_received == 1, what="the one real hint")
    assert agent.running
    link.close()
    address.close()
