"""Access records: which chunks were used, and when, written to the bucket for GC.

Object stores keep no access time, so each node remembers the chunks it served or stored and flushes them,
deduplicated, as one compact object per batch::

    _meta/access/<YYYYMMDDHH>/<node>-<pid>-<seq>.json.zst   {"v": 1, "ts": <unix s>, "keys": [...]}

GC merges these records to decide what is idle. A record's `ts` is when its chunks were last used (the
newest use of any of them: never older than the truth), not when it was written: the node agent writes
them every minute and when it stops, long after the uses it records. Losing a batch only makes a chunk look
older than it is, so flushing is best effort: failures are counted and the batch is dropped rather than
kept without bound.

`ts` is the store's time, as GC's "now" is (`kvstore.store_clock`): a node whose clock runs an hour behind
the store would otherwise stamp a use seconds ago as an hour old, and GC with a 30-minute TTL would delete
the chunk. The recorder reads the store's clock every few minutes (the `last_modified` of a marker it
writes) and adds the difference to its own, rounded so that a use never looks older than it was.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator

import zstandard

from kvstore.errors import StoreError
from kvstore.layout import ACCESS_PREFIX
from kvstore.store_clock import LISTING_RESOLUTION_S, store_now
from kvstore.stores import ObjectStore

log = logging.getLogger(__name__)

RECORD_VERSION = 1
_WINDOW_S = 10.0  # uses this close together share a record (and its timestamp, their newest)
_CLOCK_EVERY_S = 600.0  # how often the store's clock is read again (clocks drift slowly)


def encode_batch(keys: Iterable[str], ts: float) -> bytes:
    body = json.dumps({"v": RECORD_VERSION, "ts": ts, "keys": sorted(keys)}, separators=(",", ":"))
    return zstandard.ZstdCompressor(level=3).compress(body.encode())


def decode_batch(blob: bytes) -> tuple[float, list[str]]:
    data = json.loads(zstandard.ZstdDecompressor().decompress(blob, max_output_size=1 << 30))
    if data.get("v") != RECORD_VERSION:
        raise ValueError(f"unsupported access record version {data.get('v')!r}")
    return float(data["ts"]), list(data["keys"])


def read_access_records(
    store: ObjectStore, prefix: str = ACCESS_PREFIX
) -> Iterator[tuple[str, float, list[str]]]:
    """`(record key, timestamp, chunk keys)` of every readable batch under `prefix` (unreadable ones are
    skipped with a warning, and left in place)."""
    for info in store.list(prefix):
        blob = store.get(info.key)
        if blob is None:
            continue
        try:
            ts, keys = decode_batch(blob)
        except (ValueError, KeyError, TypeError, zstandard.ZstdError) as exc:
            log.warning("skipping unreadable access record %s: %s", info.key, exc)
            continue
        yield info.key, ts, keys


class AccessRecorder:
    """Buffers accessed keys with the time of their last use and flushes them every `interval_s` or
    `max_keys`, on a background thread: one record per `_WINDOW_S` of use times, stamped with its newest,
    in the store's time. `clock` is this node's (uses are recorded by it)."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        interval_s: float = 60.0,
        max_keys: int = 50_000,
        node: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._clock = clock
        self._offset: float | None = None  # the store's clock minus this node's (an upper bound)
        self._offset_read_at = 0.0  # time.monotonic() when it was read
        self._interval = interval_s
        self._max_keys = max_keys
        self._node = node or socket.gethostname()
        self._keys: dict[str, float] = {}  # key -> when it was last used
        self._seq = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.flushed_batches = 0
        self.failed_batches = 0
        self._thread = threading.Thread(target=self._run, name="kvstore-access", daemon=True)
        self._thread.start()

    def record(self, keys: Iterable[str], at: float | None = None) -> None:
        """Chunks used at `at` (unix time by this node's clock; now by default)."""
        when = self._clock() if at is None else at
        with self._lock:
            self._keys.update(dict.fromkeys(keys, when))
            full = len(self._keys) >= self._max_keys
        if full:
            self._wake.set()

    def flush(self) -> bool:
        """Write what is buffered now; False if the store refused some of it (those batches are dropped)."""
        with self._lock:
            keys, self._keys = self._keys, {}
        if not keys:
            return True
        offset = self._store_offset()
        windows: dict[int, list[str]] = {}
        for key, used in keys.items():
            windows.setdefault(int(used // _WINDOW_S), []).append(key)
        ok = True
        for window in sorted(windows):
            batch = windows[window]
            ok = self._write(batch, max(keys[k] for k in batch) + offset) and ok
        return ok

    def _store_offset(self) -> float:
        """How far the store's clock is ahead of this node's, read again every `_CLOCK_EVERY_S`. The store
        names whole seconds, truncated, so the second is added: a use may look younger, never older. Until
        the store answers once, this node's clock stands."""
        if self._offset is None or time.monotonic() - self._offset_read_at >= _CLOCK_EVERY_S:
            before = self._clock()
            try:
                store_time = store_now(
                    self._store, f"access-{self._node}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                )
            except StoreError as exc:
                log.warning("cannot read the store's clock (access records keep this node's): %s", exc)
            else:
                self._offset = store_time + LISTING_RESOLUTION_S - before
                self._offset_read_at = time.monotonic()
        return self._offset or 0.0

    def _write(self, keys: list[str], ts: float) -> bool:
        with self._lock:
            self._seq += 1
            seq = self._seq
        hour = time.strftime("%Y%m%d%H", time.gmtime(ts))
        name = f"{ACCESS_PREFIX}{hour}/{self._node}-{os.getpid()}-{seq:06d}.json.zst"
        try:
            self._store.put(name, encode_batch(keys, ts))
        except StoreError as exc:
            self.failed_batches += 1
            log.warning("dropping access record batch of %d keys: %s", len(keys), exc)
            return False
        self.flushed_batches += 1
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        self.flush()
