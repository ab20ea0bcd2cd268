"""The bucket lease: create-only taking, typed refusal, takeover of an expired lease or of one whose holder
was a process of this machine that is gone, renewal, release."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import KVStoreError
from kvstore.lease import Lease, LeaseHeld, LeaseLost, holder_gone, lease_key, read_lease, this_process
from kvstore.stores import MemoryStore
from kvstore.stores.local import LocalStore
from tests.helpers import FakeClock, wait_for

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


# A process of its own that takes the lease on a directory store, says so, and waits to be killed.
_HOLDER = """
import sys, time
from kvstore.lease import Lease
from kvstore.stores.local import LocalStore
Lease(LocalStore(sys.argv[1]), "gc", ttl_s=300, holder="doomed").acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holding_process(root: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_lease_of_a_killed_process_on_this_machine_is_taken_over_at_once(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    holder = _holding_process(tmp_path / "store")
    try:
        info = read_lease(store, "gc")
        assert info is not None and info.process is not None and info.process.pid == holder.pid
        assert info.live(time.time()) and not holder_gone(info)
        with pytest.raises(LeaseHeld, match="doomed"):  # alive: its lease stands
            Lease(store, "gc", ttl_s=60, holder="next").acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
    # Killed but not reaped yet: a zombie is gone too (once the kill has landed).
    wait_for(lambda: holder_gone(info), timeout=10, what="the killed holder to be a zombie")
    with Lease(store, "gc", ttl_s=60, holder="next"):
        info = read_lease(store, "gc")
        assert info is not None and info.holder == "next"
    holder.wait(30)
    with Lease(store, "gc", ttl_s=60, holder="after"):  # and once reaped
        pass


def _lease_of(store: MemoryStore, **process: Any) -> None:
    me = this_process()
    assert me is not None, "this test needs /proc"
    body = {"holder": "other", "token": "t" * 32, "expires_at": time.time() + 300}
    body["process"] = {"machine": me.machine, "pid": me.pid, "started": me.started, **process}
    store.put(lease_key("gc"), json.dumps(body).encode())


def test_a_reused_pid_is_not_mistaken_for_the_holder() -> None:
    store = MemoryStore("reused")
    _lease_of(store, started="1")  # our pid, but a process that started at another time
    with Lease(store, "gc", ttl_s=60, holder="taker"):
        pass


def test_a_live_holder_elsewhere_or_unknown_is_trusted_until_it_expires() -> None:
    for process in ({}, {"machine": "another-host/boot/pid:[1]", "pid": 999_999_999}):
        store = MemoryStore("trusted")
        _lease_of(store, **process)  # this very process, or one on another machine
        with pytest.raises(LeaseHeld, match="other"):
            Lease(store, "gc", ttl_s=60).acquire()
    old = MemoryStore("old")  # written before leases recorded their process
    old.put(
        lease_key("gc"), json.dumps({"holder": "old", "token": "x", "expires_at": time.time() + 300}).encode()
    )
    with pytest.raises(LeaseHeld, match="old"):
        Lease(old, "gc", ttl_s=60).acquire()
    gone = MemoryStore("gone")
    _lease_of(gone, pid=_dead_pid())
    with Lease(gone, "gc", ttl_s=60):
        pass


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    return proc.pid
