"""Placing chunk files on disk: names, atomic writes, direct reads and removal. No index, no eviction.

Layout under the cache directory::

    <dir>/chunks/<hh>/<digest>.<token>           one admitted chunk, immutable once renamed into place
    <dir>/chunks/<hh>/.<pid>.<digest>.<token>.tmp  a write in progress (or the leftover of a killed writer)
    <dir>/writers/<pid>.<random>                   a process that has the cache open to write

``digest`` is the 32-hex BLAKE2b-128 of the key's UTF-8 bytes, ``hh`` its first two hex digits (256 fan-out
directories keep directory sizes small), ``token`` 16 random hex digits drawn per admission and stored in the
index entry. Because every admission gets a fresh name, two processes racing to admit and evict the same key
can never unlink or overwrite each other's live file: a name is written once, by one writer, and removed once.

A file is written under a tmp name next to its final name and renamed only when complete, so a process
killed mid-write leaves at most a tmp file, never a partial file under a final name. The tmp file lives in
the same fan-out directory as its final name: creating files in one shared directory serialises every writer
on that directory's lock, and a rename across directories takes a filesystem-wide one (measured here: half
the write throughput at 256 KiB). Tmp names carry the writer's pid, and every writer leaves a marker in
``writers/`` while it has the cache open, so the next process to open the cache finds the writers that died
and removes their leftovers (``reclaim_tmp``) without scanning the cache when none did.

Direct I/O: files are written and read with O_DIRECT (chunk files are laid out in 4 KiB blocks for this, see
``kvstore.chunk``), so bytes move between the device and the caller's buffer without a page-cache copy, and a
node's NVMe cache does not double the RAM that vLLM's CPU tier already spends on the hot set. Where the
filesystem refuses O_DIRECT (tmpfs, some overlay and network filesystems) a probe at start-up finds out once
and every file uses buffered I/O instead. O_DIRECT needs every buffer aligned to 4 KiB in address and length;
a buffer that is not (a header held in a ``bytes``, an odd-sized tail) goes through a small per-thread
aligned buffer instead. With ``direct_writes`` off, files are written through the page cache and read with
O_DIRECT still (the kernel writes a file's dirty pages back before a direct read of them): on a disk whose
direct writes are slow and whose RAM is plenty, a store returns once its bytes are in memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.chunk import BLOCK, Buffer
from kvstore.errors import CacheError
from kvstore.processes import alive

log = logging.getLogger(__name__)

CHUNKS_DIR = "chunks"
TMP_DIR = "tmp"  # tmp files of earlier releases (reclaimed, scanned by fsck)
WRITERS_DIR = "writers"
TMP_SUFFIX = ".tmp"
TOKEN_BYTES = 8
O_DIRECT = getattr(os, "O_DIRECT", 0)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# A tmp file this old is a leftover whatever its pid says (the pid may have been reused): no write takes this
# long.
_TMP_MAX_AGE_S = 3600.0
# The cache is its owner's alone, whatever the umask (see kvstore.node.private): anyone who can read a chunk
# file reads a prompt's KV.
_FILE_MODE = 0o600
_DIR_MODE = 0o700


def key_digest(key: str) -> str:
    """The 32-hex digest that names a key's files (stable across processes and versions)."""
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def new_token() -> bytes:
    """A fresh per-admission token; 64 random bits make a collision between writers negligible."""
    return secrets.token_bytes(TOKEN_BYTES)


@dataclass(frozen=True)
class DiskFile:
    """A file found by a directory scan. ``name`` is relative to the cache directory."""

    name: str
    size: int
    mtime_ns: int
    is_tmp: bool


@dataclass(frozen=True)
class Reclaimed:
    files: int
    bytes: int


class _Aligned(threading.local):
    """Per-thread 4 KiB-aligned buffers for the pieces O_DIRECT cannot take from the caller."""

    def __init__(self) -> None:
        self.head = mmap.mmap(-1, BLOCK)  # anonymous maps are page-aligned
        self.tail = mmap.mmap(-1, BLOCK)
        self.staging = mmap.mmap(-1, BLOCK)

    def staging_of(self, nbytes: int) -> memoryview:
        if len(self.staging) < nbytes:
            self.staging.close()
            self.staging = mmap.mmap(-1, _round_up(nbytes))
        return memoryview(self.staging)[:nbytes]


def _round_up(n: int) -> int:
    return (n + BLOCK - 1) & ~(BLOCK - 1)


def _address(buf: Buffer) -> int:
    """The address of `buf`'s first byte. ctypes for writable buffers (vLLM's rows: ~0.6 us), numpy for
    read-only ones (~4 us); this runs once per stored chunk."""
    if not len(buf):
        return 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except TypeError:
        return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class ChunkFiles:
    """Writes, reads and removes chunk files under one cache directory. Safe to share between threads."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        fsync: bool = False,
        direct_io: bool = True,
        direct_writes: bool = True,
        repair: bool = False,
    ):
        """``direct_writes`` False: files are written through the page cache (the kernel writes them back) and
        still read with O_DIRECT where ``direct_io`` allows it. ``repair``: open to check and repair only
        (fsck), which must work on a full disk: no probe file is written and reads are buffered."""
        self.root = Path(directory)
        self._root_str = str(self.root)
        self.fsync = fsync
        self._chunks = self.root / CHUNKS_DIR
        self._tmp = self.root / TMP_DIR
        self._writers = self.root / WRITERS_DIR
        self._pid = 0
        self._marker = ""
        self._buffers = _Aligned()
        try:
            self.root.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
            self._chunks.mkdir(mode=_DIR_MODE, exist_ok=True)
            self._writers.mkdir(mode=_DIR_MODE, exist_ok=True)
            self.direct_io = False if repair else self._probe(direct_io)
            self.direct_writes = self.direct_io and direct_writes
        except OSError as exc:
            raise CacheError(
                f"cache directory {str(self.root)!r} is not usable: {exc.strerror or exc}"
            ) from exc

    def _probe(self, want_direct: bool) -> bool:
        """Really create, write and remove a file (permissions alone do not tell: root, read-only mounts),
        with O_DIRECT if wanted; whether O_DIRECT works here. A full disk is usable (the cache evicts to make
        room): it only hides whether O_DIRECT works, which the writes find out then (``write``)."""
        try:
            return self._try_probe(want_direct)
        except OSError as exc:
            if exc.errno not in _NO_SPACE:
                raise
            log.warning("%s is full: the cache will evict to make room", self.root)
            return bool(want_direct and O_DIRECT)

    def _try_probe(self, want_direct: bool) -> bool:
        probe = f"{self._root_str}/.{os.getpid()}.probe-{secrets.token_hex(4)}{TMP_SUFFIX}"
        page = self._buffers.head
        try:
            if want_direct and O_DIRECT:
                try:
                    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, _FILE_MODE)
                    try:
                        os.write(fd, page)
                    finally:
                        os.close(fd)
                    return True
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self.unlink_path(probe)
                    log.warning(
                        "%s refuses O_DIRECT: chunk files use buffered I/O (the page cache keeps copies)",
                        self.root,
                    )
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
            try:
                os.write(fd, page)
            finally:
                os.close(fd)
            return False
        finally:
            self.unlink_path(probe)

    def relpath(self, key: str, token: bytes) -> str:
        """The final file name of one admission, relative to the cache directory."""
        digest = key_digest(key)
        return f"{CHUNKS_DIR}/{digest[:2]}/{digest}.{token.hex()}"

    def path_str(self, key: str, token: bytes) -> str:
        """`path` as a plain string: the load hot path, where pathlib's overhead shows."""
        return f"{self._root_str}/{self.relpath(key, token)}"

    # -- writes ------------------------------------------------------------------------------------------

    def write(self, key: str, token: bytes, parts: Sequence[Buffer]) -> str:
        """Write the concatenation of ``parts`` under a tmp name, then rename it to its final name; returns
        the final path. With O_DIRECT the total must be a multiple of 4 KiB (chunk files always are).

        Raises OSError (disk full, directory removed, ...); no partial file is left under a final name.
        """
        # Plain strings: this runs once per stored chunk, inside vLLM, where pathlib's overhead holds the GIL.
        final = self.path_str(key, token)
        folder, name = final.rsplit("/", 1)
        if os.getpid() != self._pid:  # the first write of this process (or of a forked child)
            self._register_writer()
        tmp = f"{folder}/.{self._pid}.{name}{TMP_SUFFIX}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        iov: Sequence[Buffer] = parts
        if self.direct_writes:
            flags |= O_DIRECT
            iov = self._aligned_iov(parts)
        try:
            try:
                fd = os.open(tmp, flags, _FILE_MODE)
            except FileNotFoundError:
                # First admission into this fan-out directory (or fsck removed an empty one): create, retry.
                with contextlib.suppress(FileExistsError):
                    os.mkdir(folder, _DIR_MODE)
                fd = os.open(tmp, flags, _FILE_MODE)
            except OSError as exc:
                if not (self.direct_writes and exc.errno == errno.EINVAL):
                    raise
                # The probe could not tell (a full disk at start): this filesystem refuses O_DIRECT.
                log.warning("%s refuses O_DIRECT: chunk files use buffered I/O", self.root)
                self.direct_io = self.direct_writes = False
                flags &= ~O_DIRECT
                iov = parts
                fd = os.open(tmp, flags, _FILE_MODE)
            try:
                expected = sum(memoryview(p).nbytes for p in iov)
                written = os.pwritev(fd, iov, 0)
                if written != expected:  # a regular file writes short only when the disk is full
                    raise OSError(errno.ENOSPC, f"short write: {written} of {expected} bytes")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            if self.fsync:
                _fsync_dir(folder)
        except BaseException:
            self.unlink_path(tmp)
            raise
        return final

    def _aligned_iov(self, parts: Sequence[Buffer]) -> list[Buffer]:
        """``parts`` as buffers O_DIRECT accepts: the caller's own memory where it is aligned (the payload
        straight from vLLM's primary region), this thread's aligned buffers for the header block and for an
        odd-sized tail, and one staged copy of everything when the payload itself is not aligned."""
        views = [_flat(p) for p in parts]
        total = sum(len(v) for v in views)
        if total % BLOCK:
            raise ValueError(f"an O_DIRECT chunk file must be whole 4 KiB blocks, got {total} bytes")
        if len(views) == 1 and _address(views[0]) % BLOCK == 0:
            return [views[0]]  # a whole chunk in one aligned buffer (a verified GET's body): written as it is
        if len(views) >= 2 and len(views[0]) == BLOCK:
            payload = views[1]
            body = len(payload) - len(payload) % BLOCK
            if body and _address(payload) % BLOCK == 0:
                buffers = self._buffers
                buffers.head[:] = views[0]
                out: list[Buffer] = [buffers.head, payload[:body]]
                rest = bytes(payload[body:]) + b"".join(bytes(v) for v in views[2:])
                if len(rest) == BLOCK:
                    buffers.tail[:] = rest
                    out.append(buffers.tail)
                elif rest:
                    return [self._staged(views, total)]
                return out
        return [self._staged(views, total)]

    def _staged(self, views: Sequence[memoryview], total: int) -> memoryview:
        """Everything copied into this thread's aligned staging buffer (one copy, done without the GIL)."""
        staging = self._buffers.staging_of(total)
        at = 0
        target = np.frombuffer(staging, dtype=np.uint8)
        for view in views:
            target[at : at + len(view)] = np.frombuffer(view, dtype=np.uint8)
            at += len(view)
        return staging

    # -- reads -------------------------------------------------------------------------------------------

    def read_into(self, path: str, offset: int, dest: memoryview) -> int:
        """Read ``len(dest)`` bytes at ``offset`` of the file into ``dest``; the number of bytes read (less
        at the end of a short file). FileNotFoundError if the file is gone (another process evicted it).

        With O_DIRECT, an aligned ``dest`` is filled straight from the device, with no copy; any other is
        filled through this thread's staging buffer."""
        out = _flat(dest)
        if not self.direct_io:
            fd = os.open(path, os.O_RDONLY)
            try:
                return _read_fully(fd, out, offset)
            finally:
                os.close(fd)
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
        try:
            if len(out) % BLOCK == 0:
                # Optimistic: vLLM's rows are page-aligned, and the kernel refuses any other buffer with
                # EINVAL, which costs less than checking the address in Python on every read.
                try:
                    return _read_fully(fd, out, offset)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
            staging = self._buffers.staging_of(_round_up(len(out)))
            got = _read_fully(fd, staging, offset)
            n = min(got, len(out))
            np.copyto(np.frombuffer(out, dtype=np.uint8)[:n], np.frombuffer(staging, dtype=np.uint8)[:n])
            return n
        finally:
            os.close(fd)

    def read_whole(self, path: str, size: int) -> memoryview:
        """The first ``size`` bytes of the file (shorter if the file is), in this thread's staging buffer:
        valid until this thread's next read. FileNotFoundError if the file is gone."""
        staging = self._buffers.staging_of(_round_up(size))
        fd = os.open(path, os.O_RDONLY | (O_DIRECT if self.direct_io else 0))
        try:
            got = _read_fully(fd, staging, 0)
        finally:
            os.close(fd)
        return staging[: min(got, size)]

    # -- removal and scans -------------------------------------------------------------------------------

    def unlink(self, key: str, token: bytes) -> None:
        self.unlink_path(self.path_str(key, token))

    def unlink_path(self, path: str | Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def _register_writer(self) -> None:
        marker = f"{self._writers}/{os.getpid()}.{secrets.token_hex(4)}"
        # On a full disk this may fail: the next write tries again.
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE))
        self._pid, self._marker = os.getpid(), marker

    def close(self) -> None:
        """This process writes no more: its marker goes (a marker left behind means it died)."""
        if self._marker and self._pid == os.getpid():
            self.unlink_path(self._marker)
            self._marker = ""

    def reclaim_tmp(self) -> Reclaimed:
        """Remove the tmp files of writers that died (their marker is left and their pid is gone), and of
        earlier releases' ``tmp/``; what it freed. Without a dead writer, nothing is scanned."""
        dead: set[int] = set()
        markers: list[str] = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self._writers) as found:
            for entry in found:
                pid = _writer_pid(entry.name)
                if pid is not None and pid != os.getpid() and not alive(pid):
                    dead.add(pid)
                    markers.append(entry.path)
        files = freed = 0
        now = time.time()
        for disk_file in self._scan_dir(self._tmp, is_tmp=True):
            self.unlink_path(self.root / disk_file.name)
            files += 1
            freed += disk_file.size
        if dead:
            for disk_file in self._scan_dir(self._chunks, is_tmp=False):
                if not disk_file.is_tmp:
                    continue
                pid = _writer_pid(disk_file.name)
                if pid in dead or now - disk_file.mtime_ns / 1e9 > _TMP_MAX_AGE_S:
                    self.unlink_path(self.root / disk_file.name)
                    files += 1
                    freed += disk_file.size
        for marker in markers:  # after the files: a crash in between only repeats the scan
            self.unlink_path(marker)
        return Reclaimed(files, freed)

    def scan(self) -> Iterator[DiskFile]:
        """Every file under ``chunks/`` and ``tmp/`` (fsck's view of the disk)."""
        for sub, is_tmp in ((self._tmp, True), (self._chunks, False)):
            yield from self._scan_dir(sub, is_tmp)

    def _scan_dir(self, directory: Path, is_tmp: bool) -> Iterator[DiskFile]:
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            return
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    if not is_tmp:
                        yield from self._scan_dir(Path(entry.path), is_tmp)
                    continue
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while we scanned (a concurrent eviction)
            name = os.path.relpath(entry.path, self.root)
            tmp = is_tmp or entry.name.endswith(TMP_SUFFIX)
            yield DiskFile(name=name, size=st.st_size, mtime_ns=st.st_mtime_ns, is_tmp=tmp)


def _flat(buf: Buffer) -> memoryview:
    view = memoryview(buf)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _read_fully(fd: int, buf: Buffer, offset: int) -> int:
    """Fill ``buf`` from ``offset``; fewer bytes only where the file ends."""
    view = _flat(buf)
    got = os.preadv(fd, [view], offset)
    while 0 < got < len(view):  # a short read mid-file is legal, if rare; at the end of the file it is 0
        more = os.preadv(fd, [view[got:]], offset + got)
        if more == 0:
            break
        got += more
    return got


def _writer_pid(name: str) -> int | None:
    """The pid in a tmp file's or a writer marker's name (``.<pid>.<...>.tmp``, ``<pid>.<random>``)."""
    head = name.rsplit("/", 1)[-1].lstrip(".").split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _fsync_dir(directory: str | Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
