"""A node's pins follow the bucket's: `apply_pins` pins on this node's NVMe cache the chunk keys of every live
manifest (`kvstore.pins`) and unpins the ones it pinned earlier that no manifest names any more, and
`PinSyncLoop` repeats that on a thread, so a pin created anywhere reaches every node within one interval."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from kvstore.cache.nvme import NVMeCache
from kvstore.errors import ConfigError, KVStoreError
from kvstore.pins import pinned_keys
from kvstore.stores.base import ObjectStore

__all__ = ["PinSync", "PinSyncLoop", "apply_pins"]

log = logging.getLogger(__name__)

_APPLIED_FILE = "pins-applied.json"


@dataclass(frozen=True)
class PinSync:
    """What one `apply_pins` run changed on the node."""

    pinned: int
    unpinned: int
    total: int


def apply_pins(cache: NVMeCache, store: ObjectStore) -> PinSync:
    """Make the node's pins match the bucket: pin keys of live manifests, unpin keys this function pinned
    earlier that no manifest names any more. Pins taken by anything else (other tools, tests) are untouched,
    because only this function's own record (`<cache_dir>/pins-applied.json`) is ever unpinned.

    Serialised across the node's processes by an flock; the record is replaced atomically after the LMDB
    commits, so a crash in between re-applies at most one run's delta on the next call."""
    desired = pinned_keys(store)
    directory = Path(cache.directory)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / (_APPLIED_FILE + ".lock"), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        applied = _load_applied(directory / _APPLIED_FILE)
        to_pin = sorted(desired - applied)
        to_unpin = sorted(applied - desired)
        if to_pin:
            cache.pin(to_pin)
        if to_unpin:
            cache.unpin(to_unpin)
        if to_pin or to_unpin or not (directory / _APPLIED_FILE).exists():
            _save_applied(directory / _APPLIED_FILE, desired)
    return PinSync(pinned=len(to_pin), unpinned=len(to_unpin), total=len(desired))


class PinSyncLoop:
    """`apply_pins` every `interval_s` on a daemon thread, so a pin created anywhere (another node's admin
    service, the CLI) reaches this node's cache within one interval. Failures are logged and retried."""

    def __init__(self, cache: NVMeCache, store: ObjectStore, interval_s: float = 60.0) -> None:
        self._cache, self._store, self._interval = cache, store, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-pin-sync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                apply_pins(self._cache, self._store)
            except KVStoreError as exc:
                log.warning("pin sync failed (retrying in %.0f s): %s", self._interval, exc)
            if self._stop.wait(self._interval):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _load_applied(path: Path) -> set[str]:
    try:
        return set(json.loads(path.read_bytes())["keys"])
    except FileNotFoundError:
        return set()
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is corrupt ({exc}); remove it and re-run to re-apply pins") from None


def _save_applied(path: Path, keys: set[str]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".pins-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps({"keys": sorted(keys)}).encode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
