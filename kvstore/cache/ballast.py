"""Room held for the index on a disk that something else filled.

The index commits by writing pages, so a disk that another file filled to the last byte would keep the cache
from committing anything, its evictions included, and with them the only way it has to give room back. The
cache keeps a file of its own (``<cache_dir>/ballast``) holding a little room: when a commit that makes room
finds the disk full, the ballast goes and the commit is tried again in a size that fits; the ballast comes
back once the disk has room for it twice over. It is sized to a small share of the filesystem (256 KiB to
16 MiB), and like any other file it is space the cache's budget leaves to others.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os

log = logging.getLogger(__name__)

NAME = "ballast"
_MIN_BYTES = 256 << 10
_MAX_BYTES = 16 << 20
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class Ballast:
    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = os.path.join(os.fspath(directory), NAME)
        self._directory = os.fspath(directory)

    def size(self) -> int:
        """The room it holds: 1/256 of the filesystem, within 256 KiB and 16 MiB."""
        st = os.statvfs(self._directory)
        return max(_MIN_BYTES, min(_MAX_BYTES, st.f_blocks * st.f_frsize // 256))

    def release(self) -> bool:
        """Give its room back (the disk is full); whether there was any to give."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        log.warning("the disk of %s is full: released the ballast so the cache can commit", self._directory)
        return True

    def restore(self) -> None:
        """Put it back where the disk has room for it twice over (a full disk is left alone). Best effort."""
        try:
            size = self.size()
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_size >= size:
                    return
            st = os.statvfs(self._directory)
            if st.f_bavail * st.f_frsize < 2 * size:
                return
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)  # a part of it would only be taken for all of it
            log.debug("could not put the ballast of %s back: %s", self._directory, exc)
