"""Placing chunk files on disk: names, atomic writes, reads and removal. No index, no eviction.

Layout under the cache directory::

    <dir>/chunks/<hh>/<digest>.<token>    one admitted chunk blob, immutable once renamed into place
    <dir>/tmp/<digest>.<token>.tmp         a write in progress (or a leftover of a crashed writer)

``digest`` is the 32-hex BLAKE2b-128 of the key's UTF-8 bytes, ``hh`` its first two hex digits (256 fan-out
directories keep directory sizes small), ``token`` 16 random hex digits drawn per admission and stored in the
index entry. Because every admission gets a fresh name, two processes racing to admit and evict the same key
can never unlink or overwrite each other's live file: a name is written once, by one writer, and removed once.

A file is written to ``tmp/`` and renamed into ``chunks/`` only when complete, so a process killed mid-write
leaves at most a tmp file (an orphan for fsck), never a partial file under a final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import CacheError

CHUNKS_DIR = "chunks"
TMP_DIR = "tmp"
TMP_SUFFIX = ".tmp"
TOKEN_BYTES = 8


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


class ChunkFiles:
    """Writes, reads and removes chunk files under one cache directory. Safe to share between threads."""

    def __init__(self, directory: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.root = Path(directory)
        self._root_str = str(self.root)
        self.fsync = fsync
        self._chunks = self.root / CHUNKS_DIR
        self._tmp = self.root / TMP_DIR
        self._tmp_str = str(self._tmp)
        try:
            self._tmp.mkdir(parents=True, exist_ok=True)
            self._chunks.mkdir(exist_ok=True)
            self._probe()
        except OSError as exc:
            raise CacheError(
                f"cache directory {str(self.root)!r} is not usable: {exc.strerror or exc}"
            ) from exc

    def _probe(self) -> None:
        # Permissions alone do not tell (root, read-only mounts, full disks): really create and remove a file.
        probe = self._tmp / f".probe-{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
        probe.unlink()

    def relpath(self, key: str, token: bytes) -> str:
        """The final file name of one admission, relative to the cache directory."""
        digest = key_digest(key)
        return f"{CHUNKS_DIR}/{digest[:2]}/{digest}.{token.hex()}"

    def path(self, key: str, token: bytes) -> Path:
        return self.root / self.relpath(key, token)

    def path_str(self, key: str, token: bytes) -> str:
        """`path` as a plain string: the load hot path, where pathlib's overhead shows."""
        return f"{self._root_str}/{self.relpath(key, token)}"

    def write(self, key: str, token: bytes, blob: bytes | memoryview) -> str:
        """Write ``blob`` under a tmp name, then rename it to its final name; returns the final path.

        Raises OSError (disk full, directory removed, ...); no partial file is left under a final name.
        """
        # Plain strings: this runs once per stored chunk, inside vLLM, where pathlib's overhead holds the GIL.
        final = self.path_str(key, token)
        folder, name = final.rsplit("/", 1)
        tmp = f"{self._tmp_str}/{name}{TMP_SUFFIX}"
        try:
            with open(tmp, "xb") as f:
                f.write(blob)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            try:
                os.rename(tmp, final)
            except FileNotFoundError:
                # First admission into this fan-out directory (or fsck removed an empty one): create, retry.
                with contextlib.suppress(FileExistsError):
                    os.mkdir(folder)
                os.rename(tmp, final)
            if self.fsync:
                _fsync_dir(folder)
        except BaseException:
            self.unlink_path(tmp)
            raise
        return final

    def read(self, key: str, token: bytes) -> bytes | None:
        """The file's bytes, or None if it is gone (another process evicted it, or a crash lost it)."""
        try:
            with open(self.path(key, token), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def unlink(self, key: str, token: bytes) -> None:
        self.unlink_path(self.path(key, token))

    def unlink_path(self, path: str | Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

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
            yield DiskFile(name=name, size=st.st_size, mtime_ns=st.st_mtime_ns, is_tmp=is_tmp)


def _fsync_dir(directory: str | Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
