"""A node's pins follow the bucket's: `apply_pins` pins on this node's NVMe cache the chunk keys of every live
manifest (`kvstore.pins`) and unpins the ones it pinned earlier that no manifest names any more, and
`PinSyncLoop` repeats that on a thread, so a pin created anywhere reaches every node within one interval.

One bad manifest never holds back the others: an unreadable one is skipped (`kvstore.pins.list_pins`), and a
key no cache can hold (longer than the index's key limit) is left out, logged with its manifest and counted
(`PinSync.skipped`), while every other key is pinned."""

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
from kvstore.cache.records import MAX_KEY_BYTES, encode_key
from kvstore.errors import CacheError, ConfigError, KVStoreError
from kvstore.pins import list_pins
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
    skipped: int = 0  # keys of live manifests this node cannot pin (too long for its index), each logged


def _cacheable(key: str) -> bool:
    try:
        encode_key(key)
    except CacheError:
        return False
    return True


def _desired(store: ObjectStore) -> tuple[set[str], set[str]]:
    """The keys of the live manifests that a cache can pin, and those it cannot (logged by manifest)."""
    desired: set[str] = set()
    skipped: set[str] = set()
    for manifest in list_pins(store, include_expired=False):
        bad = [k for k in manifest.keys if not _cacheable(k)]
        if bad:
            log.warning(
                "pin %r: %d of its keys are longer than the NVMe cache's %d-byte key limit and are not "
                "pinned on this node (e.g. %r...)",
                manifest.name,
                len(bad),
                MAX_KEY_BYTES,
                bad[0][:80],
            )
            skipped.update(bad)
            desired.update(k for k in manifest.keys if k not in skipped)
        else:
            desired.update(manifest.keys)
    return desired - skipped, skipped


def apply_pins(cache: NVMeCache, store: ObjectStore) -> PinSync:
    """Make the node's pins match the bucket: pin keys of live manifests, unpin keys this function pinned
    earlier that no manifest names any more. Pins taken by anything else (other tools, tests) are untouched,
    because only this function's own record (`<cache_dir>/pins-applied.json`) is ever unpinned.

    Serialised across the node's processes by an flock; the record is replaced atomically after the LMDB
    commits, so a crash in between re-applies at most one run's delta on the next call, and a record that
    cannot be written (a full disk) takes the delta back before the error goes on."""
    desired, skipped = _desired(store)
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
            try:
                _save_applied(directory / _APPLIED_FILE, desired)
            except OSError:
                # Unrecorded, the delta would be applied again by every retry: pins counted up while the
                # disk is full, never all taken back.
                if to_pin:
                    cache.unpin(to_pin)
                if to_unpin:
                    cache.pin(to_unpin)
                raise
    return PinSync(pinned=len(to_pin), unpinned=len(to_unpin), total=len(desired), skipped=len(skipped))


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
            except (KVStoreError, OSError) as exc:  # OSError: the applied set's file on a full disk
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
