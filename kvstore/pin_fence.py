"""The fence between GC's deletes and pin creation: no chunk is deleted while a manifest naming it exists.

GC re-reads the pin manifests before each delete batch, but a re-read alone leaves a window: a manifest
written after the re-read and before the delete. Two markers close it. Each side announces itself before it
looks at the other (the flag protocol of Dekker and Peterson, over single-object operations that S3,
SeaweedFS and MinIO make linearizable, listings included):

- GC, around each delete batch (`DeleteFence.batch`): (g1) write the marker `_meta/gc/deleting.json` (its
  lease token, a deadline); (g2) list the holds in `_meta/gc/holds/`: if a live one exists, remove the
  marker, wait for the holds to go and start again; (g3) re-read the pins and drop pinned keys from the
  batch; (g4) delete, before the marker's deadline; (g5) remove the marker.
- A pin creator (`fenced_pin_write`): (c1) write a hold `_meta/gc/holds/<id>.json` with a deadline;
  (c2) read the marker and, while a live one exists, wait for it to go; (c3) write the manifest, before the
  hold's deadline; (c4) remove the hold.

Why no interleaving deletes a chunk of a manifest M while M exists: suppose a batch deletes such a chunk at
g4, after M was written at c3. Its re-read g3 missed M, so g3 came before c3. Its hold listing g2 (before
g3, so before c3 and c4) saw no live hold: the hold was not written yet, so g1 < g2 < c1 < c2. The marker
written at g1 is removed only at g5, after g4, after c3, so c2 found it; a live marker made the creator wait
until it was gone, i.e. until after g4, before writing M at c3. Contradiction.

"Live" relies on clocks agreeing within the margins below (seconds; NTP does far better) and on the lease's
own assumption that a GC does not stall for minutes between renewing the lease and its next request. A
crashed GC leaves a marker that creators wait out (its deadline, or its lease expiring or changing hands);
a crashed creator leaves a hold that GC waits out (its deadline). A GC killed on the creator's own machine
stops closing the fence at once (`kvstore.lease.holder_gone`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from kvstore.errors import KVStoreError, StoreError
from kvstore.layout import GC_HOLD_PREFIX, GC_MARKER_KEY
from kvstore.lease import Lease, holder_gone, read_lease
from kvstore.stores.base import ObjectStore

__all__ = [
    "DeleteFence",
    "FenceTimeout",
    "fenced_pin_write",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# GC's marker: creators treat it as live this long at most; GC starts its delete only while at least
# `PHASE_MARGIN_S` of it are left, which covers one bounded delete request and clock disagreement.
PHASE_TTL_S = 120.0
PHASE_MARGIN_S = 60.0
# A creator's hold: GC respects it this long; the creator writes its manifest only while `HOLD_MARGIN_S`
# of it are left (one bounded PUT, plus clock disagreement), else it renews the hold first.
HOLD_TTL_S = 30.0
HOLD_MARGIN_S = 10.0
_POLL_S = 0.1
_HOLD_KEEP_S = 3600.0  # expired holds older than this are removed by GC (their creators are long gone)


class FenceTimeout(KVStoreError):
    """The other side of the fence kept it closed longer than the caller is willing to wait."""


def _until(blob: bytes | None) -> float | None:
    if blob is None:
        return None
    try:
        data: Any = json.loads(blob)
        return float(data["until"])
    except (ValueError, KeyError, TypeError):
        return 0.0  # unreadable: expired, so a torn or foreign object cannot close the fence for good


class DeleteFence:
    """GC's side of the fence: `with fence.batch() as until:` around the pins re-read and the delete of one
    batch; the delete must be sent before `until - PHASE_MARGIN_S` (`in_time(until)` says whether it may)."""

    def __init__(
        self,
        store: ObjectStore,
        lease: Lease,
        *,
        hold_wait_s: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._lease = lease
        self._hold_wait_s = hold_wait_s
        self._clock = clock
        self.waited_s = 0.0  # total time spent letting pin creators through (reported by GC)

    def _live_holds(self) -> list[str]:
        now = self._clock()
        live: list[str] = []
        dead: list[str] = []
        for info in self._store.list(GC_HOLD_PREFIX):
            until = _until(self._store.get(info.key))
            if until is not None and until > now:
                live.append(info.key)
            elif until is not None and until < now - _HOLD_KEEP_S:
                dead.append(info.key)  # left by a creator that crashed long ago
        if dead:
            self._store.delete_many(dead)
        return live

    @contextlib.contextmanager
    def batch(self) -> Iterator[float]:
        deadline = time.monotonic() + self._hold_wait_s
        while True:
            until = self._clock() + PHASE_TTL_S
            marker = {"token": self._lease.token, "holder": self._lease.holder, "until": until}
            self._store.put(GC_MARKER_KEY, json.dumps(marker).encode())
            if not self._live_holds():
                break
            # A creator is between its hold and its manifest: step back so it can finish, then re-announce.
            self._store.delete(GC_MARKER_KEY)
            began = time.monotonic()
            while self._live_holds():
                if time.monotonic() > deadline:
                    raise FenceTimeout(f"pin creation held GC's deletes back for {self._hold_wait_s:.0f} s")
                time.sleep(_POLL_S)
            self.waited_s += time.monotonic() - began
        try:
            yield until
        finally:
            self._store.delete(GC_MARKER_KEY)

    def in_time(self, until: float) -> bool:
        return self._clock() < until - PHASE_MARGIN_S


def _marker_live(store: ObjectStore, now: float) -> bool:
    blob = store.get(GC_MARKER_KEY)
    until = _until(blob)
    if until is None or until <= now:
        return False
    assert blob is not None
    try:
        token = str(json.loads(blob)["token"])
    except (ValueError, KeyError, TypeError):
        return False
    # A marker whose GC no longer holds a live lease was left by a crash (or a GC that lost its lease,
    # which stops before its next delete): it does not close the fence. Nor does one whose GC was a process
    # of this machine that is gone (its lease is taken over at once, `kvstore.lease.holder_gone`).
    lease = read_lease(store, "gc")
    return lease is not None and lease.token == token and lease.live(now) and not holder_gone(lease)


def fenced_pin_write(
    store: ObjectStore,
    write: Callable[[], _T],
    *,
    wait_s: float = PHASE_TTL_S + 30.0,
    clock: Callable[[], float] = time.time,
) -> _T:
    """Run `write` (the manifest write of a pin) on the creator's side of the fence; see the module
    docstring. Waits while a GC delete batch is in flight (normally well under a second); `FenceTimeout`
    after `wait_s`."""
    hold_key = f"{GC_HOLD_PREFIX}{uuid.uuid4().hex}.json"
    deadline = time.monotonic() + wait_s
    try:
        while True:
            until = clock() + HOLD_TTL_S
            store.put(hold_key, json.dumps({"until": until}).encode())
            while _marker_live(store, clock()) and clock() < until - HOLD_MARGIN_S:
                if time.monotonic() > deadline:
                    raise FenceTimeout(f"a GC delete batch kept the pin fence closed for {wait_s:.0f} s")
                time.sleep(_POLL_S)
            if clock() < until - HOLD_MARGIN_S:
                return write()
            # Waited so long that the hold is about to lapse: renew it and look at the marker again.
    finally:
        try:
            store.delete(hold_key)
        except StoreError as exc:  # GC waits out the hold's deadline instead; nothing is lost
            log.warning("could not remove pin hold %s (it expires in %.0f s): %s", hold_key, HOLD_TTL_S, exc)
