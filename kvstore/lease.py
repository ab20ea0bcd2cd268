"""A named, expiring lease kept as one object in the bucket, so only one fleet-wide job (GC) runs at a time.

The lease object `_meta/leases/<name>.json` holds `{"holder", "token", "expires_at"}`. Taking it is a
create-only write (`put_if_absent`): of several racing takers exactly one wins. A holder that crashes just
leaves the object behind; once `expires_at` has passed it may be taken over.

Takeover must not let two takers both delete "the stale lease" (the second delete would remove the first
taker's fresh lease). So a taker first claims the stale lease by its token, create-only, at
`_meta/leases/<name>.json.takeover/<stale token>`: exactly one taker wins the claim, and only it deletes the
stale object and races `put_if_absent` for a fresh one. Claims are kept (a deleted claim could be won again
by a slow taker) and pruned once a day old. As a last line of defence every `renew` re-reads the lease and
raises `LeaseLost` when the token is no longer ours, and guarded jobs are idempotent (GC is).

A holder that dies on the machine where the next taker runs need not be waited out: the lease records its
process (`HolderProcess`: the machine, as host name + boot id + PID namespace, the pid and the process's start
time), and a taker on the same machine takes a live lease over at once when that process is gone (no such pid,
a zombie, or a pid reused by a process that started at another time). A holder elsewhere, or one whose process
this machine cannot see, is trusted until `expires_at`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from kvstore.errors import KVStoreError
from kvstore.layout import LEASE_PREFIX
from kvstore.processes import start_time
from kvstore.stores import ObjectStore

__all__ = [
    "HolderProcess",
    "Lease",
    "LeaseHeld",
    "LeaseInfo",
    "LeaseLost",
    "default_holder",
    "holder_gone",
    "process_gone",
    "read_lease",
    "this_process",
]

log = logging.getLogger(__name__)

_CLAIM_KEEP_S = 86_400.0  # takeover claims older than this are pruned (no taker is that slow)


class LeaseHeld(KVStoreError):
    """Someone else holds a live lease; the message names the holder and when it expires."""


class LeaseLost(KVStoreError):
    """The lease we held expired and was taken over (or removed) while we were still working."""


@dataclass(frozen=True, slots=True)
class HolderProcess:
    """The process holding a lease: its machine (host name, boot id, PID namespace), pid and start time (in
    clock ticks since boot, from `/proc/<pid>/stat`), which together tell a reused pid from the holder."""

    machine: str
    pid: int
    started: str


@functools.cache
def _machine() -> str | None:
    """This machine, as far as pids go: the same host name, boot and PID namespace; `None` without /proc."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{socket.gethostname()}/{boot}/{namespace}"


def this_process() -> HolderProcess | None:
    """This process as a lease records it; `None` where the machine cannot be identified (no /proc)."""
    machine, started = _machine(), start_time(os.getpid())
    if machine is None or started is None:
        return None
    return HolderProcess(machine, os.getpid(), started)


def process_gone(pid: int, started: str | None) -> bool:
    """Whether the process of this machine that had ``pid`` and started at ``started`` (`start_time`; None if
    not known) no longer runs: no such pid, a zombie, or a pid reused by another process. An unreadable
    start time (a /proc mounted with hidepid) proves nothing, so the process is trusted. GC's lease and the
    upload journal's claims (`kvstore.cache.claims`) take over from a holder that is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists, under another user
    now = start_time(pid)
    return now is not None and started is not None and now != started


def _process_gone(process: HolderProcess) -> bool:
    return process_gone(process.pid, process.started)


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """The decoded lease object."""

    holder: str
    token: str
    expires_at: float
    process: HolderProcess | None = None  # absent in leases written before it was recorded

    def live(self, now: float) -> bool:
        return self.expires_at > now


def holder_gone(info: LeaseInfo) -> bool:
    """Whether the lease's holder is a process of this machine that no longer runs (`kill -9`, a crash):
    then the lease can be taken over at once instead of after `expires_at`."""
    process = info.process
    return process is not None and process.machine == _machine() and _process_gone(process)


def default_holder() -> str:
    """A human-readable holder name: host and pid (the token, not this, is what identifies a taker)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def lease_key(name: str) -> str:
    return f"{LEASE_PREFIX}{name}.json"


def _decode(blob: bytes) -> LeaseInfo | None:
    try:
        data: Any = json.loads(blob)
        info = LeaseInfo(str(data["holder"]), str(data["token"]), float(data["expires_at"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # unreadable: treated as expired, so a torn or foreign object cannot block GC forever
    try:
        p = data["process"]
        process = HolderProcess(str(p["machine"]), int(p["pid"]), str(p["started"]))
    except (KeyError, TypeError, ValueError):
        return info  # no (readable) process: the lease is trusted until it expires
    return LeaseInfo(info.holder, info.token, info.expires_at, process)


def read_lease(store: ObjectStore, name: str = "gc") -> LeaseInfo | None:
    """The current lease object, live or not; `None` if absent or unreadable."""
    blob = store.get(lease_key(name))
    return None if blob is None else _decode(blob)


class Lease:
    """One taker's handle on the lease `name`; use as a context manager (acquire on enter, release on exit).

    `renew()` must be called more often than `ttl_s` (GC renews between batches); `clock` is injectable so
    tests can expire a lease without sleeping.
    """

    def __init__(
        self,
        store: ObjectStore,
        name: str = "gc",
        *,
        ttl_s: float = 300.0,
        holder: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s must be > 0, got {ttl_s}")
        self._store = store
        self.name = name
        self.key = lease_key(name)
        self._claims = f"{self.key}.takeover/"
        self.ttl_s = ttl_s
        self.holder = holder or default_holder()
        self.token = uuid.uuid4().hex
        self._process = this_process()
        self._clock = clock
        self._held = False
        self._renewed_at = 0.0

    @property
    def held(self) -> bool:
        return self._held

    def _body(self) -> bytes:
        body: dict[str, Any] = {
            "holder": self.holder,
            "token": self.token,
            "expires_at": self._clock() + self.ttl_s,
        }
        if self._process is not None:
            body["process"] = asdict(self._process)
        return json.dumps(body).encode()

    def acquire(self) -> None:
        """Take the lease or raise `LeaseHeld`; an expired (or unreadable) lease is taken over, and so is a
        live one whose holder was a process of this machine that is gone."""
        blob: bytes | None = None
        for _ in range(3):  # absent between our create and our read (a release or a takeover): retry
            if self._store.put_if_absent(self.key, self._body()):
                self._mark_held()
                return
            blob = self._store.get(self.key)
            if blob is not None:
                break
        if blob is None:
            raise LeaseHeld(f"lease {self.name!r} keeps changing hands; try again")
        current = _decode(blob)
        if current is not None and current.live(self._clock()):
            if not holder_gone(current):
                raise LeaseHeld(
                    f"lease {self.name!r} is held by {current.holder!r} until "
                    f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(current.expires_at))}"
                )
            assert current.process is not None
            log.warning(
                "lease %r: its holder %r (pid %d on this machine) is gone; taking it over",
                self.name,
                current.holder,
                current.process.pid,
            )
        # Stale (expired, unreadable or its holder gone): claim this particular stale lease first, so only one
        # taker deletes it.
        stale_token = current.token if current is not None else hashlib.sha256(blob).hexdigest()[:32]
        if not self._store.put_if_absent(f"{self._claims}{stale_token}", self.token.encode()):
            raise LeaseHeld(f"lease {self.name!r}: another taker is taking over the expired lease")
        self._store.delete(self.key)
        if not self._store.put_if_absent(self.key, self._body()):
            winner = read_lease(self._store, self.name)
            who = winner.holder if winner is not None else "another taker"
            raise LeaseHeld(f"lease {self.name!r} was taken first by {who!r}")
        self._mark_held()
        self._prune_claims()

    def _prune_claims(self) -> None:
        cutoff = time.time() - _CLAIM_KEEP_S
        old = [info.key for info in self._store.list(self._claims) if info.last_modified < cutoff]
        if old:
            self._store.delete_many(old)

    def _mark_held(self) -> None:
        self._held = True
        self._renewed_at = self._clock()

    def renew(self) -> None:
        """Push `expires_at` forward; raise `LeaseLost` if the lease is no longer ours."""
        if not self._held:
            raise LeaseLost(f"lease {self.name!r} is not held")
        current = read_lease(self._store, self.name)
        if current is None or current.token != self.token:
            self._held = False
            raise LeaseLost(f"lease {self.name!r} was lost (expired and taken over, or removed)")
        self._store.put(self.key, self._body())
        self._renewed_at = self._clock()

    def maybe_renew(self) -> None:
        """Renew once a third of the TTL has passed since the last renewal; cheap to call per object."""
        if self._clock() - self._renewed_at >= self.ttl_s / 3:
            self.renew()

    def release(self) -> None:
        """Delete the lease if it is still ours (never someone else's)."""
        if not self._held:
            return
        self._held = False
        current = read_lease(self._store, self.name)
        if current is not None and current.token == self.token:
            self._store.delete(self.key)

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
