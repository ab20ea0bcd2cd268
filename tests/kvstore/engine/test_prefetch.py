"""The prefetch buffer: bounded by bytes, each chunk handed out once, dropped when no load takes it."""

from __future__ import annotations

from kvstore.engine.io import Fetched
from kvstore.engine.prefetch import PrefetchBuffer
from tests.helpers import FakeClock


def held(key: str, size: int, region: str | None = None) -> Fetched:
    return Fetched(key, b"x" * size, region)


def test_buffer_is_bounded_by_bytes_and_hands_each_chunk_out_once() -> None:
    buffer = PrefetchBuffer(10)
    a = held("a", 6, "local")
    assert buffer.offer(a)
    assert not buffer.offer(held("b", 6))  # would exceed 10 bytes
    assert buffer.offer(held("c", 4))
    assert buffer.held_bytes == 10
    assert buffer.take("a") is a
    assert buffer.take("a") is None
    assert buffer.held_bytes == 4
    assert buffer.offer(held("b", 6))


def test_buffer_drops_what_no_load_takes_in_time() -> None:
    clock = FakeClock(0.0)
    buffer = PrefetchBuffer(10, ttl_s=5.0, clock=clock)
    assert buffer.offer(held("old", 10))
    clock.now = 6.0
    assert buffer.take("old") is None
    assert buffer.held_bytes == 0
    assert buffer.offer(held("x", 10))
    clock.now = 20.0
    y = held("y", 10)
    assert buffer.offer(y)  # the expired "x" made room
    assert buffer.take("y") is y


def test_disabled_buffer_is_off() -> None:
    assert not PrefetchBuffer(0).enabled
