"""Deferred index flushes: LMDB commits without an fsync each, made durable together once per interval.

Why: on a disk with a volatile write cache (a cloud VM's virtio disk, most NVMe drives without power-loss
protection) an fsync flushes everything written since the last one, every chunk file included. So an index
commit that syncs waits for the data of every chunk stored before it: measured here, an fdatasync of a
4 KiB page took 0.2 ms alone and 112 ms after 256 chunk files of 256 KiB, and it was 40% of a store's time
(`bench tiers`, medians of three runs: stores at 0.70x / 0.46x vLLM's `fs` tier at 256 KiB / 2 MiB syncing
each commit, 1.30x / 0.98x flushed once a second). vLLM's `fs` tier never syncs.

The price, and how it is paid: without its own sync LMDB stays consistent after a *process* crash (the
kernel holds its pages), but a *machine* crash can write a commit's meta page and not the pages it points
at, leaving an index that cannot be trusted. So a process that opens the index this way first leaves a
marker in the index directory naming the boot it runs in and its pid, durable before its first commit, and
removes it only after its last flush. At open:

* a marker of another boot means the machine stopped while commits may not have reached the disk: the
  index is suspect (`IndexSuspect`) and is rebuilt from the chunk files before anyone uses it
  (`kvstore.cache.fsck.open_recovering`);
* a marker of this boot whose process is gone is harmless (its commits are in the page cache): the opener
  flushes them and removes it.

A commit is visible to every process at once either way; only its durability waits for the next flush. A
forked child's commits are flushed by its parent's flusher, which flushes every process's commits, while
the parent has the index open.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

import lmdb

from kvstore.errors import IndexSuspect
from kvstore.processes import alive

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_FLUSH_S",
    "IndexFlusher",
    "boot_id",
    "check_markers",
    "leave_marker",
    "reap",
    "suspect",
    "sync",
]

DEFAULT_FLUSH_S = 1.0  # a machine crash loses at most this much of the index's commits (and then rebuilds)

_PREFIX = "unflushed."
_MARKER = re.compile(r"^unflushed\.([0-9a-f]{32})\.(\d+)\.[0-9a-f]+$")
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str | None:
    """This boot's id (Linux); None where the kernel does not say, and deferred flushes are then off."""
    try:
        raw = _BOOT_ID.read_text().strip().replace("-", "")
    except OSError:
        return None
    return raw if re.fullmatch(r"[0-9a-f]{32}", raw) else None


@dataclass(frozen=True)
class _Marker:
    path: str
    boot: str
    pid: int


def _markers(index_dir: str) -> list[_Marker]:
    found: list[_Marker] = []
    with contextlib.suppress(FileNotFoundError), os.scandir(index_dir) as entries:
        for entry in entries:
            match = _MARKER.match(entry.name)
            if match:
                found.append(_Marker(entry.path, match.group(1), int(match.group(2))))
    return found


def check_markers(index_dir: str, boot: str) -> list[str]:
    """Raise IndexSuspect if a process of another boot left commits that may not be on disk; the markers of
    this boot's processes that are gone (to remove once their commits are flushed)."""
    markers = _markers(index_dir)
    other = [m for m in markers if m.boot != boot]
    if other:
        raise IndexSuspect(
            f"cache index {index_dir!r} was open with deferred flushes when the machine stopped "
            f"(pid {other[0].pid}): commits may be missing from its pages, so it must be rebuilt from the "
            "chunk files (`kvstore fsck --fix`; a cache opened by kvstore does it itself)"
        )
    return [m.path for m in markers if m.pid != os.getpid() and not alive(m.pid)]


def leave_marker(index_dir: str, boot: str) -> str:
    """This process's marker, on disk (file and directory entry) before it commits anything unflushed."""
    path = os.path.join(index_dir, f"{_PREFIX}{boot}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    directory = os.open(index_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return path


def sync(env: lmdb.Environment) -> bool:
    """Make every commit so far durable (any process's: they share the page cache); False if the disk
    refused, logged (the next flush tries again)."""
    try:
        env.sync(True)
    except lmdb.Error as exc:
        log.warning("flushing the cache index failed: %s", exc)
        return False
    return True


def reap(env: lmdb.Environment, markers: list[str]) -> None:
    """Flush the commits of this boot's dead processes (the page cache holds them); drop their markers."""
    if sync(env):
        _unlink_all(markers)


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def suspect(index_dir: str) -> bool:
    """Whether a machine crash may have damaged the index (a marker of another boot is there)."""
    boot = boot_id()
    return any(m.boot != boot for m in _markers(index_dir))


class IndexFlusher:
    """Flushes an environment opened without LMDB's per-commit sync every ``interval_s`` when anything was
    committed (by any process), on a thread of its own; `close` flushes once more and removes the marker."""

    def __init__(self, env: lmdb.Environment, interval_s: float, marker: str) -> None:
        self._env = env
        self._interval_s = interval_s
        self._marker = marker
        self._flushed = -1
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one flush at a time (the thread's and `close`'s)
        self._thread = threading.Thread(target=self._run, name="kvstore-index-flush", daemon=True)
        self._thread.start()

    @property
    def flushed_txnid(self) -> int:
        """The last transaction known to be on disk (-1 before the first flush)."""
        return self._flushed

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.flush()

    def flush(self) -> bool:
        """Make every commit so far durable; False if the disk refused (the next flush tries again)."""
        with self._lock:
            last = self._env.info()["last_txnid"]
            if last != self._flushed:
                if not sync(self._env):
                    return False
                self._flushed = last
            return True

    def close(self) -> None:
        """Stop the thread and flush; the marker goes only once every commit is on disk."""
        self._stop.set()
        self._thread.join()
        if self.flush():
            _unlink_all([self._marker])
