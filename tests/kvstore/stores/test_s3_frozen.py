"""S3Store against a frozen server (SIGSTOP): it accepts connections (the kernel does) and never answers.
Every call must give up with `StoreUnavailable` within its deadline, not wait a minute, and work again once
the server resumes. The bounds asserted are generous (a slow machine must not fail them); the README's
reliability table has the measured figures."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest

from kvstore.errors import StoreUnavailable
from kvstore.stores import S3Store

if TYPE_CHECKING:  # the root conftest is not importable by name under every pytest import mode
    from conftest import S3Server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DATA_PATH_BOUND_S = 10.0  # the data-path deadline is 5 s; it used to take 60-89 s
CONTROL_PATH_BOUND_S = 20.0  # listings and bucket checks: about 11 s; they used to take 80 s


@pytest.fixture
def frozen(private_s3_server: S3Server) -> Iterator[tuple[S3Store, Callable[[], None], Callable[[], None]]]:
    """A store on a server of its own, and functions that freeze and thaw that server."""
    bucket = f"kvt-{uuid.uuid4().hex[:16]}"
    private_s3_server.client().make_bucket(bucket)

    def freeze() -> None:
        private_s3_server.freeze(True)

    def thaw() -> None:
        private_s3_server.freeze(False)

    with private_s3_server.store(bucket, "p") as store:
        try:
            yield store, freeze, thaw
        finally:
            thaw()


def _fails_within(call: Callable[[], object], bound: float) -> float:
    began = time.monotonic()
    with pytest.raises(StoreUnavailable):
        call()
    took = time.monotonic() - began
    assert took < bound, f"gave up after {took:.1f} s"
    return took


def test_every_call_gives_up_within_its_deadline_on_a_frozen_server(
    frozen: tuple[S3Store, Callable[[], None], Callable[[], None]],
) -> None:
    store, freeze, thaw = frozen
    store.put("kept", b"x" * 4096)
    assert store.get("kept") is not None  # a pooled connection exists: a request is sent, then no answer
    freeze()
    calls: dict[str, tuple[Callable[[], object], float]] = {
        "get": (lambda: store.get("kept"), DATA_PATH_BOUND_S),
        "get_range": (lambda: store.get_range("kept", 0, 10), DATA_PATH_BOUND_S),
        "exists_many": (lambda: store.exists_many(["kept", "other", "third"]), DATA_PATH_BOUND_S),
        "put": (lambda: store.put("new", b"y" * 4096), DATA_PATH_BOUND_S),
        "put_if_absent": (lambda: store.put_if_absent("new2", b"y"), DATA_PATH_BOUND_S),
        "check": (store.check, CONTROL_PATH_BOUND_S),
        "list": (lambda: list(store.list()), CONTROL_PATH_BOUND_S),
        "delete_many": (lambda: store.delete_many(["a", "b"]), CONTROL_PATH_BOUND_S),
    }
    # All at once, as the engine's threads would call: each one's own wait is what is measured.
    with ThreadPoolExecutor(len(calls)) as pool:
        waits = {name: pool.submit(_fails_within, call, bound) for name, (call, bound) in calls.items()}
        for name, future in waits.items():
            try:
                future.result()
            except BaseException as exc:  # pytest's own failures included: say which call it was
                raise AssertionError(f"{name} on the frozen server: {exc}") from exc
    thaw()
    deadline = time.monotonic() + 30
    while True:  # the server resumes where it stopped; the store needs no reopening
        try:
            assert store.get("kept") == b"x" * 4096
            break
        except StoreUnavailable:
            assert time.monotonic() < deadline, "the store did not recover after the server resumed"
            time.sleep(0.2)
    store.put("new", b"z")
    assert store.exists_many(["kept", "new", "nope"]) == [True, True, False]
