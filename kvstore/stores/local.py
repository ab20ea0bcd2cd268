"""A store over a local directory: one file per key, written atomically.

Writes go to a temporary file with a unique name in the target directory, then `os.replace` (overwrite)
or `os.link` (create-only, fails if the key exists) makes them visible in one step, so readers never see a
partial object and racing create-only writers cannot both win. Chunk-sized writes (whole 4 KiB blocks)
bypass the page cache with O_DIRECT where the filesystem allows it. Temporary files start with `_TMP_PREFIX`;
keys may not use it, and listings skip it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from typing_extensions import override

from kvstore.errors import StoreError, StoreUnavailable
from kvstore.stores.base import Data, ObjectInfo, ObjectStore, as_bytes_view, check_range, validate_key

__all__ = ["LocalStore"]

_TMP_PREFIX = ".kvstore-tmp-"
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_BLOCK = 4096
# A concurrent delete may remove a freshly created empty parent directory; writers retry that few times.
_DIR_RACE_RETRIES = 5


class LocalStore(ObjectStore):
    """Objects as files under `root`; keys map to relative paths."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        self._root = Path(root).absolute()
        if create:
            self._root.mkdir(parents=True, exist_ok=True)

    @property
    def root(self) -> Path:
        return self._root

    @property
    @override
    def url(self) -> str:
        return self._root.as_uri()

    def _path(self, key: str) -> Path:
        validate_key(key)
        if any(segment.startswith(_TMP_PREFIX) for segment in key.split("/")):
            raise ValueError(f"invalid store key {key!r}: segments may not start with {_TMP_PREFIX!r}")
        return self._root / key

    @override
    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as exc:
            raise StoreError(f"reading {key!r} from {self._root}: {exc}") from exc

    @override
    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        check_range(start, length)
        path = self._path(key)
        try:
            with path.open("rb") as f:
                f.seek(start)
                return f.read(length)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as exc:
            raise StoreError(f"reading {key!r} from {self._root}: {exc}") from exc

    def _write_tmp(self, path: Path, data: Data) -> Path:
        """Write `data` to a uniquely named temporary file next to `path` and return its path."""
        view = as_bytes_view(data)
        for _ in range(_DIR_RACE_RETRIES):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{_TMP_PREFIX}{path.name}.{uuid.uuid4().hex}")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:
                continue  # the parent was removed by a concurrent delete between mkdir and open
            try:
                _write_all(fd, view)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            finally:
                os.close(fd)
            return tmp
        raise StoreError(f"cannot create the directory for {path} (removed concurrently, repeatedly)")

    @override
    def put(self, key: str, data: Data) -> None:
        path = self._path(key)
        try:
            tmp = self._write_tmp(path, data)
            try:
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise _translate(exc, f"writing {key!r} under {self._root}") from exc

    @override
    def put_if_absent(self, key: str, data: Data) -> bool:
        path = self._path(key)
        try:
            tmp = self._write_tmp(path, data)
            try:
                # link() refuses an existing target, which makes create-only race-free across processes.
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise _translate(exc, f"writing {key!r} under {self._root}") from exc

    @override
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [self._path(key).is_file() for key in keys]

    @override
    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise _translate(exc, f"deleting {key!r} under {self._root}") from exc
        self._prune_empty_dirs(path.parent)

    def _prune_empty_dirs(self, directory: Path) -> None:
        # Best effort: GC deletes many chunks, empty fan-out directories would otherwise pile up.
        while directory != self._root:
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent

    @override
    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[ObjectInfo]:
        yield from self._walk(self._root, "", prefix, start_after)

    def _walk(self, directory: Path, base: str, prefix: str, start_after: str | None) -> Iterator[ObjectInfo]:
        try:
            with os.scandir(directory) as it:
                entries = [e for e in it if not e.name.startswith(_TMP_PREFIX)]
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise _translate(exc, f"listing {directory}") from exc
        # A directory sorts as "name/": that makes the depth-first walk yield keys in plain string order.
        named = sorted(
            ((base + e.name + ("/" if e.is_dir(follow_symlinks=False) else ""), e) for e in entries),
            key=lambda pair: pair[0],
        )
        for name, entry in named:
            if name.endswith("/"):
                overlaps_prefix = name.startswith(prefix) or prefix.startswith(name)
                before_cursor = (
                    start_after is not None and name < start_after and not start_after.startswith(name)
                )
                if overlaps_prefix and not before_cursor:
                    yield from self._walk(Path(entry.path), name, prefix, start_after)
                continue
            if not name.startswith(prefix) or (start_after is not None and name <= start_after):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted while we listed
            yield ObjectInfo(name, st.st_size, st.st_mtime)

    @override
    def check(self) -> None:
        if not self._root.is_dir():
            raise StoreUnavailable(f"store directory {self._root} does not exist")
        if not os.access(self._root, os.W_OK | os.X_OK):
            raise StoreError(f"store directory {self._root} is not writable")


def _write_all(fd: int, view: memoryview) -> None:
    """Write `view` to `fd`. Chunks (whole 4 KiB blocks, from an aligned upload buffer) go with O_DIRECT:
    buffered, every uploaded chunk would sit in the page cache and its writeback would compete with the
    NVMe cache's own O_DIRECT I/O. Whatever O_DIRECT refuses (another alignment, a filesystem without it)
    is written buffered."""
    if _O_DIRECT and view.nbytes and view.nbytes % _BLOCK == 0:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
            if os.pwritev(fd, [view], 0) == view.nbytes:
                return
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], done)


def _translate(exc: OSError, what: str) -> StoreError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):
        return StoreUnavailable(f"{what}: {exc}")
    return StoreError(f"{what}: {exc}")
