"""Upload claims: who holds a chunk of the upload journal, and until when.

An uploader claims a batch of queued chunks for a lease; another process takes a claim over once it has
expired, or at once when its holder is a process of this node that is gone (a killed agent's claims would
otherwise wait out their lease), as GC's lease is (``kvstore.lease.process_gone`` decides for both). A claim
is judged by the node's boot clock (``CLOCK_BOOTTIME``), never by the wall clock: every process on the node
reads the same one, nobody can set it, so a clock stepped back an hour cannot stretch a two-minute claim
into an hour. A claim made in another boot is void: its holder is gone and its times count from another
zero.

``claims``  journal record key -> ``<Q8s8sIQ``: until when (boot clock ns), the boot it was made in, and its
            holder: PID namespace, pid and start time (clock ticks since boot); pid 0 for no holder (a failed
            upload's retry time). Boot and namespace are digests of ``/proc``'s names for them.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from kvstore.lease import process_gone
from kvstore.processes import start_time

__all__ = ["Claim", "Holder", "Liveness", "clock_ns", "this_process"]

_CLAIM = struct.Struct("<Q8s8sIQ")
_UNKNOWN = bytes(8)  # no /proc: a claim is judged by its time alone


def clock_ns() -> int:
    """The node's boot clock, which claims count in."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


@functools.cache
def _boot() -> bytes:
    try:
        return _digest(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        return _UNKNOWN


@functools.cache
def _pid_namespace() -> bytes:
    try:
        return _digest(os.readlink("/proc/self/ns/pid"))
    except OSError:
        return _UNKNOWN


@dataclass(frozen=True, slots=True)
class Holder:
    """A process that holds claims, as the node's other processes can check it."""

    pid_namespace: bytes
    pid: int
    started: int  # clock ticks since boot; 0 where unknown


_NOBODY = Holder(_UNKNOWN, 0, 0)


def this_process() -> Holder:
    """This process (after a fork, the child)."""
    return _holder(os.getpid())


@functools.cache
def _holder(pid: int) -> Holder:
    started = start_time(pid)
    return Holder(_pid_namespace(), pid, int(started) if started and started.isdigit() else 0)


@dataclass(frozen=True, slots=True)
class Claim:
    until_ns: int
    boot: bytes
    holder: Holder

    @classmethod
    def of(cls, until_ns: int, holder: Holder | None) -> Claim:
        """A claim made now, in this boot (``holder`` None: a retry time nobody holds)."""
        return cls(until_ns, _boot(), holder or _NOBODY)

    def pack(self) -> bytes:
        h = self.holder
        return _CLAIM.pack(self.until_ns, self.boot, h.pid_namespace, h.pid, h.started)

    @classmethod
    def unpack(cls, raw: bytes) -> Claim:
        until, boot, namespace, pid, started = _CLAIM.unpack(raw)
        return cls(until, boot, Holder(namespace, pid, started))


class Liveness:
    """Whether claims still hold, asking the kernel about each holder once (one per transaction)."""

    def __init__(self, now_ns: int) -> None:
        self.now_ns = now_ns
        self._gone: dict[Holder, bool] = {}

    def holds(self, claim: Claim) -> bool:
        if claim.boot != _boot() or claim.until_ns <= self.now_ns:
            return False
        holder = claim.holder
        if holder.pid == 0 or holder.pid_namespace != _pid_namespace() or holder.pid_namespace == _UNKNOWN:
            return True  # a retry time, or a holder whose pids this process cannot see: its time decides
        gone = self._gone.get(holder)
        if gone is None:
            gone = self._gone[holder] = _gone(holder)
        return not gone


def _gone(holder: Holder) -> bool:
    if holder.pid == os.getpid():
        return False
    return process_gone(holder.pid, str(holder.started) if holder.started else None)
