"""The bucket lease: create-only taking, typed refusal, takeover of an expired lease, renewal, release."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kvstore.errors import KVStoreError
from kvstore.lease import Lease, LeaseHeld, LeaseLost, lease_key, read_lease
from kvstore.stores import MemoryStore
from tests.helpers import FakeClock

pytestmark = pytest.mark.integration


def test_acquire_refuse_release(s3_store: Any) -> None:
    first = Lease(s3_store, "gc", ttl_s=60, holder="alpha")
    with first:
        info = read_lease(s3_store, "gc")
        assert info is not None and info.holder == "alpha" and info.token == first.token
        with pytest.raises(LeaseHeld, match="alpha") as caught:
            Lease(s3_store, "gc", ttl_s=60, holder="beta").acquire()
        assert isinstance(caught.value, KVStoreError)
        # Another name is another lease.
        with Lease(s3_store, "other", ttl_s=60):
            pass
    assert read_lease(s3_store, "gc") is None
    with Lease(s3_store, "gc", ttl_s=60, holder="beta"):
        pass


def test_stale_lease_is_taken_over(s3_store: Any) -> None:
    clock = FakeClock(1_000_000.0)
    crashed = Lease(s3_store, "gc", ttl_s=30, holder="crashed", clock=clock)
    crashed.acquire()  # and never released: the process "died"
    with pytest.raises(LeaseHeld):
        Lease(s3_store, "gc", ttl_s=30, holder="early", clock=clock).acquire()
    clock.now += 31
    taker = Lease(s3_store, "gc", ttl_s=30, holder="taker", clock=clock)
    taker.acquire()
    info = read_lease(s3_store, "gc")
    assert info is not None and info.holder == "taker"
    # The crashed holder, should it wake up, finds out at its next renewal and never deletes the new lease.
    with pytest.raises(LeaseLost):
        crashed.renew()
    crashed.release()
    assert read_lease(s3_store, "gc") is not None
    taker.release()
    assert read_lease(s3_store, "gc") is None


def test_unreadable_lease_counts_as_expired(s3_store: Any) -> None:
    s3_store.put(lease_key("gc"), b"garbage")
    with Lease(s3_store, "gc", ttl_s=30, holder="fixer"):
        info = read_lease(s3_store, "gc")
        assert info is not None and info.holder == "fixer"


def test_renew_extends_expiry() -> None:
    store = MemoryStore("lease")
    clock = FakeClock(1_000_000.0)
    lease = Lease(store, "gc", ttl_s=30, clock=clock)
    lease.acquire()
    clock.now += 20
    lease.maybe_renew()  # past a third of the TTL: renews
    clock.now += 20  # 40 s after acquiring, 20 after renewing: still live
    with pytest.raises(LeaseHeld):
        Lease(store, "gc", ttl_s=30, clock=clock).acquire()
    lease.release()
    assert not lease.held


def test_racing_takeover_has_one_winner(s3_store: Any) -> None:
    clock = FakeClock(1_000_000.0)
    Lease(s3_store, "gc", ttl_s=5, holder="dead", clock=clock).acquire()
    clock.now += 10
    barrier = threading.Barrier(6)
    outcomes: list[str] = []

    def take(i: int) -> None:
        lease = Lease(s3_store, "gc", ttl_s=600, holder=f"t{i}", clock=clock)
        barrier.wait()
        try:
            lease.acquire()
            outcomes.append("won")
        except LeaseHeld:
            outcomes.append("refused")

    threads = [threading.Thread(target=take, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcomes) == ["refused"] * 5 + ["won"]
    info = read_lease(s3_store, "gc")
    assert info is not None and info.holder.startswith("t")


def test_bad_ttl() -> None:
    with pytest.raises(ValueError):
        Lease(MemoryStore(), ttl_s=0)
