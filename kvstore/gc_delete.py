"""Deleting what GC chose: batches of chunk deletions, each through the pin fence, under the lease.

Each batch goes through the pin fence (`kvstore.pin_fence`): the pins are re-read right before the delete,
and keys pinned meanwhile are spared (they survive after all). The lease is renewed before each batch, so a
GC that lost its lease to another never deletes again; a cancelled run stops before its next batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.errors import KVStoreError, StoreUnavailable
from kvstore.lease import Lease
from kvstore.pin_fence import DeleteFence
from kvstore.pins import PinView
from kvstore.stores import ObjectStore

__all__ = ["Deleter", "GCCancelled", "Victim", "check_cancel"]


@dataclass(frozen=True, slots=True)
class Victim:
    """A chunk chosen for deletion: why (`ttl` or `budget`) and its merged access time, kept in case a pin
    created meanwhile spares it."""

    key: str
    size: int
    reason: str
    ts: float | None


class GCCancelled(KVStoreError):
    """The run was cancelled (`cancel` was set); nothing after the last completed batch was deleted."""


class Deleter:
    """Batches deletions, `batch` keys each; keys pinned by the time their batch goes are spared
    (`take_spared`, survivors after all). Deleted batches go to `on_removed`."""

    def __init__(
        self,
        store: ObjectStore,
        lease: Lease,
        pins: PinView,
        is_pinned: Callable[[str], bool],
        dry_run: bool,
        on_removed: Callable[[list[str]], None] | None,
        cancel: threading.Event | None,
        batch: int,
    ) -> None:
        self._store = store
        self._lease = lease
        self._pins = pins
        self._is_pinned = is_pinned
        self._dry_run = dry_run
        self._on_removed = on_removed
        self._cancel = cancel
        self._batch_size = batch
        self.fence = DeleteFence(store, lease)
        self._batch: list[Victim] = []
        self._spared: list[Victim] = []
        self.deleted: dict[str, int] = {"ttl": 0, "budget": 0}  # in a dry run: would have deleted
        self.freed = 0

    def add(self, victim: Victim) -> None:
        self._batch.append(victim)
        if len(self._batch) >= self._batch_size:
            self.flush()

    def take_spared(self) -> list[Victim]:
        """The victims a pin created meanwhile saved at delete time, since the last call."""
        spared, self._spared = self._spared, []
        return spared

    def _split(self, batch: list[Victim]) -> list[Victim]:
        doomed = [v for v in batch if not self._is_pinned(v.key)]
        if len(doomed) < len(batch):
            self._spared.extend(v for v in batch if self._is_pinned(v.key))
        return doomed

    def _count(self, done: list[Victim]) -> None:
        for victim in done:
            self.deleted[victim.reason] += 1
            self.freed += victim.size

    def flush(self) -> None:
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        check_cancel(self._cancel)
        self._lease.renew()  # raises LeaseLost before deleting if another GC took over
        if self._dry_run:
            self._pins.refresh()
            self._count(self._split(batch))
            return
        for _ in range(3):
            with self.fence.batch() as until:
                self._pins.refresh()
                doomed = self._split(batch)
                if not self.fence.in_time(until):
                    batch = doomed  # the re-read took too long to trust the marker: announce again
                    continue
                keys = [v.key for v in doomed]
                if keys:
                    self._store.delete_many(keys)
                self._count(doomed)
                break
        else:
            raise StoreUnavailable("GC could not re-read the pins within its delete window three times")
        if keys and self._on_removed is not None:
            self._on_removed(keys)


def check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise GCCancelled("GC cancelled")
