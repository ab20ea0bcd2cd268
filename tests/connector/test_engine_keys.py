"""Reading the engine's key scheme (`kvstore.connector.engine_keys`)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from kvstore.connector import engine_keys
from kvstore.hashing import DEFAULT_HASH_ALGO
from kvstore.key_scheme import KeyScheme, scheme_for


def test_outside_an_engine_the_wait_looks_less_and_less_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier built outside an engine never sees NONE_HASH: its thread looks at once, then 20 ms, 40 ms...
    apart (at most a second), not 50 times a second for as long as it waits."""
    looks: list[float] = []

    def not_set() -> tuple[KeyScheme, bool]:
        looks.append(time.monotonic())
        return scheme_for(DEFAULT_HASH_ALGO), False

    monkeypatch.setattr(engine_keys, "engine_scheme", not_set)
    scheme, from_engine = engine_keys.wait_for_engine_scheme(1.5, threading.Event())
    assert not from_engine and scheme == scheme_for(DEFAULT_HASH_ALGO)
    assert 6 <= len(looks) <= 9  # 0, 0.02, 0.06, 0.14, 0.30, 0.62, 1.26 s, then the deadline's
    gaps = [b - a for a, b in itertools.pairwise(looks)]
    assert all(later >= earlier for earlier, later in itertools.pairwise(gaps[:-1]))  # the last: the deadline


def test_an_engine_setting_it_is_seen_within_the_first_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0

    def set_on_third() -> tuple[KeyScheme, bool]:
        nonlocal calls
        calls += 1
        return scheme_for("sha256"), calls >= 3

    monkeypatch.setattr(engine_keys, "engine_scheme", set_on_third)
    started = time.monotonic()
    scheme, from_engine = engine_keys.wait_for_engine_scheme(120, threading.Event())
    assert from_engine and scheme == scheme_for("sha256") and calls == 3
    assert time.monotonic() - started < 5  # two short waits, not the timeout (a bound, not a timing)


def test_stop_ends_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # (An engine started earlier in this process may have set NONE_HASH: the wait must not find it.)
    monkeypatch.setattr(engine_keys, "engine_scheme", lambda: (scheme_for(DEFAULT_HASH_ALGO), False))
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    started = time.monotonic()
    _, from_engine = engine_keys.wait_for_engine_scheme(120, stop)
    assert not from_engine and time.monotonic() - started < 5
