"""Hints from engines to the node agent over the cache directory's datagram socket: split by bytes, kept
while the agent is away, and whatever a datagram holds, the agent keeps running and stores only what it can
(keys the index holds, the counters engines publish, bounded)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvstore.agent.inbox import HintInbox
from kvstore.agent.node_agent import NodeAgent
from kvstore.cache import NVMeCache
from kvstore.engine.node_counters import NodeCounters
from kvstore.metrics import EngineMetrics
from kvstore.node import link as link_module
from kvstore.node.hints import (
    COUNTERS,
    MAX_DATAGRAM,
    MAX_INCREMENT,
    Hints,
    SocketAddress,
    datagrams,
    decode,
    encode,
)
from kvstore.node.link import AgentLink
from tests.helpers import sample, wait_for


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
        link.stored(touched[:3])
        link.counters({"nvme.hits": 5, "nvme.queries": 0})
        assert link.send()
        receiver.join(10)
        assert [k for h in received for k in h.touched] == touched
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
    link.stored(["c"])
    link.counters({"nvme.hits": 2})
    assert not link.send()
    assert link.pending and link.dropped == 0
    inbox = HintInbox(tmp_path)  # the agent comes up
    try:
        assert link.send()
        got = inbox.receive(timeout=2)
        assert [k for h in got for k in h.touched] == ["a", "b"]
        assert [k for h in got for k in h.stored] == ["c"]
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


def test_keys_of_many_bytes_each_are_split_by_bytes_and_all_arrive(tmp_path: Path) -> None:
    """Datagrams are sized in encoded bytes: 3,000 keys of Cyrillic and CJK characters (2 and 3 bytes each)
    once made one datagram of ~540 KB that no socket takes, resent and refused for good, counted nowhere."""
    inbox = HintInbox(tmp_path)
    link = AgentLink(tmp_path)
    cyrillic = [f"ns_abc_r0/{'ключ' * 15}/{i:05d}.bin" for i in range(1500)]
    cjk = [f"ns_abc_r0/{'键值缓存' * 15}/{i:05d}.bin" for i in range(1500)]
    received: list[Hints] = []

    def receive() -> None:
        while len([k for h in received for k in h.touched]) < len(cyrillic + cjk):
            got = inbox.receive(timeout=5)
            if not got:
                return
            received.extend(got)

    receiver = threading.Thread(target=receive)
    receiver.start()
    try:
        link.touched(cyrillic + cjk)
        assert link.send(), "every datagram fits"
        receiver.join(30)
        assert [k for h in received for k in h.touched] == cyrillic + cjk
        assert link.dropped == 0
        assert inbox.rejected == 0
    finally:
        link.close()
        inbox.close()


def test_a_key_no_datagram_can_carry_is_dropped_and_counted(tmp_path: Path) -> None:
    inbox = HintInbox(tmp_path)
    link = AgentLink(tmp_path)
    try:
        link.touched(["k/1.bin", "x" * (MAX_DATAGRAM + 1), "k/2.bin"])
        assert link.send()
        assert [k for h in inbox.receive(timeout=2) for k in h.touched] == ["k/1.bin", "k/2.bin"]
        assert link.dropped == 1
    finally:
        link.close()
        inbox.close()


def _send(directory: str, payloads: list[bytes]) -> None:
    address = SocketAddress(directory)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        for payload in payloads:  # blocking: each waits for room in the agent's queue
            address.send(sock, payload)
    address.close()


def test_no_datagram_stops_the_agent_and_each_bad_one_is_counted(
    cache: NVMeCache, start_agent: Callable[..., NodeAgent]
) -> None:
    """An empty counter name, one of 600 bytes, 2**64-1 twice, a negative or zero increment, keys the index
    cannot hold, msgpack nested 2,000 deep: each once raised out of the agent's loop (MDB_BAD_VALSIZE,
    struct.error, RecursionError) and stopped it."""
    metrics = EngineMetrics(CollectorRegistry())
    agent = start_agent(cache, None, metrics)
    bad = [
        Hints(1, counters={"": 1}),
        Hints(1, counters={"n" * 600: 1}),
        Hints(1, counters={"nvme.hits": 2**64 - 1}),
        Hints(1, counters={"nvme.hits": 2**64 - 1}),
        Hints(1, counters={"nvme.hits": -5}),
        Hints(1, counters={"nvme.hits": 0}),
        Hints(1, touched=["", "k" * 600]),
        Hints(1, stored=["k" * 511]),
        Hints(1, touched=["k" * 1000]),
    ]
    nested = b"\x82\xa3pid\x01\xa1x" + b"\x91" * 2000 + b"\xc0"  # deeper than msgpack's decoder recurses
    _send(cache.directory, [encode(h) for h in bad] + [b"", b"not msgpack", nested])
    link = AgentLink(cache.directory)
    link.touched(["k/1.bin"])
    link.counters({"nvme.hits": 3})
    assert link.send_within(30)  # the agent's queue may be full of the bad ones a moment
    link.close()
    wait_for(lambda: cache.counters().get("nvme.hits") == 3, what="the good hint after the bad ones")
    assert agent.running
    assert agent.hints_rejected == len(bad) + 3
    assert sample(metrics, "kvstore:agent_hints_rejected_total") == len(bad) + 3
    assert set(cache.counters()) <= COUNTERS


def test_only_the_counters_engines_publish_are_kept(
    cache: NVMeCache, start_agent: Callable[..., NodeAgent]
) -> None:
    """Every new name once became a row of the index: 1.79M names in 20 s grew it by 250 MB."""
    agent = start_agent(cache, None)
    made_up = [encode(Hints(1, counters={f"made.up.{i}": 1, "nvme.queries": 1})) for i in range(200)]
    _send(cache.directory, made_up)
    wait_for(lambda: cache.counters().get("nvme.queries") == 200, what="the known counter's increments")
    assert set(cache.counters()) == {"nvme.queries"}
    assert agent.hints_rejected == 200


def test_a_counter_stops_growing_far_below_its_64_bits(
    cache: NVMeCache, start_agent: Callable[..., NodeAgent]
) -> None:
    agent = start_agent(cache, None)
    biggest = encode(Hints(1, counters={"object.read_bytes": MAX_INCREMENT}))
    rounds = (1 << 64) // MAX_INCREMENT + 10  # enough to overflow an unbounded 64-bit sum
    _send(cache.directory, [biggest] * rounds)
    wait_for(lambda: agent.hints_received >= rounds, timeout=120, what="every datagram taken")
    assert agent.running
    assert 0 < cache.counters()["object.read_bytes"] < 1 << 63


def test_every_counter_an_engine_publishes_is_one_the_agent_accepts() -> None:
    counters = NodeCounters(EngineMetrics(CollectorRegistry()), lambda _: None)
    assert set(counters._current()) <= COUNTERS  # the names it publishes, zeros included


def test_datagrams_are_sized_in_bytes_not_characters() -> None:
    keys_ = [f"ns_abc_r0/{'键值' * 40}/{i:05d}.bin" for i in range(3000)]  # 3 bytes a character
    messages, too_long = datagrams(1, keys_, [], {})
    assert too_long == 0 and len(messages) > 1
    assert all(len(encode(m)) <= MAX_DATAGRAM for m in messages)
    assert [k for m in messages for k in m.touched] == keys_
