"""How much the NVMe cache may hold on its disk, and how it evicts when the disk is full.

The budget is ``cache_bytes`` or, where the filesystem has less room (a smaller disk than configured, other
files), what the cache holds plus what is free minus a reserve for everything else (``effective_budget``):
a full disk makes the cache evict, never stop caching. A disk that another file filled to the last byte
does not stop it either: the room an eviction's commit needs is held by a ballast file (``ballast.py``),
released when a commit finds no room, then a few chunks are evicted in a transaction that fits there; their
files give room back, and the ballast returns once the disk has room for it again.
"""

from __future__ import annotations

import logging
import os

from kvstore.cache.ballast import Ballast
from kvstore.cache.index import CacheIndex
from kvstore.cache.records import Eviction
from kvstore.errors import CacheError, CacheFull

log = logging.getLogger(__name__)

# Free space the cache leaves to everything else on its filesystem: 2% of it, at most this.
_RESERVE_MAX_BYTES = 1 << 30
_FULL_DISK_BYTES = 64 << 10  # less free than this: the index may not find room for a commit
_FULL_DISK_VICTIMS = 8  # evicted by a commit that must fit in the ballast's room


class Room:
    def __init__(self, directory: str, budget_bytes: int, index: CacheIndex) -> None:
        self._directory = directory
        self._budget = budget_bytes
        self._index = index
        self._ballast = Ballast(directory)

    def effective_budget(self, written_bytes: int = 0) -> int:
        """What the cache may hold now: ``budget_bytes``, or less where its filesystem has less room (what
        the cache holds, plus ``written_bytes`` of files written and not yet committed, plus the free space,
        minus a reserve for everything else on that filesystem)."""
        free, total = self.space()
        room = self._index.used_bytes() + written_bytes + free - min(_RESERVE_MAX_BYTES, total // 50)
        return max(0, min(self._budget, room))

    def evict(self, target_bytes: int, keep_pending: bool = False) -> Eviction:
        """The index's eviction down to ``target_bytes``, through a full disk if need be (see the module
        docstring); CacheError when not even the ballast's room lets the index commit."""
        try:
            return self._index.evict(max(0, target_bytes), keep_pending=keep_pending)
        except CacheError as exc:
            # LMDB reports a short write (a full disk) as EIO, not only ENOSPC.
            if not (isinstance(exc, CacheFull) or self.space()[0] < _FULL_DISK_BYTES):
                raise
            if not self._ballast.release():
                raise
            return self._index.evict(max(0, target_bytes), _FULL_DISK_VICTIMS, keep_pending=keep_pending)

    def keep_ballast(self) -> None:
        """Release the ballast on a disk too full to write a page, put it back once there is room."""
        try:
            free, _ = self.space()
            if free < _FULL_DISK_BYTES:
                self._ballast.release()
            else:
                self._ballast.restore()
        except (OSError, CacheError) as exc:
            log.debug("cannot tend the ballast of %s: %s", self._directory, exc)

    def space(self) -> tuple[int, int]:
        """(bytes free for this process, filesystem size) where the cache lives."""
        try:
            st = os.statvfs(self._directory)
        except OSError as exc:
            raise CacheError(f"cannot read the free space of {self._directory!r}: {exc}") from exc
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize

    def warn_if_disk_is_smaller(self) -> None:
        try:
            budget = self.effective_budget()
        except (OSError, CacheError):
            return
        if budget < self._budget:
            log.warning(
                "cache_bytes is %d but %s has room for only %d (used by the cache and free, less a reserve): "
                "the cache keeps to the free space and evicts to stay there",
                self._budget,
                self._directory,
                budget,
            )
