"""The prefetch buffer: bounded by bytes, each blob handed out once, dropped when no load takes it."""

from __future__ import annotations

from kvstore.engine.prefetch import PrefetchBuffer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_buffer_is_bounded_by_bytes_and_hands_each_blob_out_once() -> None:
    buffer = PrefetchBuffer(10)
    assert buffer.offer("a", b"123456", "local")
    assert not buffer.offer("b", b"123456", None)  # would exceed 10 bytes
    assert buffer.offer("c", b"1234", None)
    assert buffer.held_bytes == 10
    assert buffer.take("a") == (b"123456", "local")
    assert buffer.take("a") is None
    assert buffer.held_bytes == 4
    assert buffer.offer("b", b"123456", None)


def test_buffer_drops_what_no_load_takes_in_time() -> None:
    clock = Clock()
    buffer = PrefetchBuffer(10, ttl_s=5.0, clock=clock)
    assert buffer.offer("old", b"1234567890", None)
    clock.now = 6.0
    assert buffer.take("old") is None
    assert buffer.held_bytes == 0
    assert buffer.offer("x", b"1234567890", None)
    clock.now = 20.0
    assert buffer.offer("y", b"1234567890", None)  # the expired "x" made room
    assert buffer.take("y") == (b"1234567890", None)


def test_disabled_buffer_is_off() -> None:
    assert not PrefetchBuffer(0).enabled
