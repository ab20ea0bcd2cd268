"""The tiered read/write engine: a node's NVMe cache in front of the shared object store.

Read path:  NVMe (index says present) -> verify -> caller's buffer,
            else chunks still queued for upload (memory),
            else object GET -> verify -> caller's buffer, then admitted to NVMe in the background.
Write path: encode once, write to NVMe now (tmp + rename + index commit), upload write-behind through a
            byte-bounded queue. A slow or absent object store makes stores drop (counted), never block.

Every chunk is verified on every read; a chunk that fails is a miss, its bad copy is removed and
`kvstore:checksum_failures` counts it. Object-store failures open a short circuit breaker
(`outage_cooldown_s`) during which the engine answers from NVMe alone instead of waiting on timeouts.

Threads: all public methods are thread-safe. `lookup(wait=False)` never blocks on the network; the other
calls do blocking I/O and are meant for the caller's worker threads (the vLLM tier runs them off the
scheduler thread). Internal work runs on two small pools: `io` (object GETs/HEADs, NVMe admission) and
`upload` (write-behind).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum

from kvstore.cache import NVMeCache
from kvstore.chunk import HEADER_SIZE, Codec, decode, decode_into, encode, parse_header, read_verified
from kvstore.engine.probes import ProbeCache
from kvstore.engine.uploads import UploadQueue
from kvstore.errors import ChunkError, ChunkFormatError, ConfigError, KVStoreError, StoreError
from kvstore.metrics import EngineMetrics
from kvstore.stores import ObjectStore

log = logging.getLogger(__name__)

_MAX_PENDING_PROBES = 65_536
_MAX_EVENTS = 65_536


class Presence(Enum):
    LOCAL = "local"  # on this node (NVMe, or still in the upload queue): loadable without the network
    REMOTE = "remote"  # in the object store
    MISS = "miss"
    PENDING = "pending"  # an existence probe is in flight; ask again


@dataclass(frozen=True)
class ChunkEvent:
    """A chunk became available in, or left, a tier (the vLLM tier turns these into KV events)."""

    key: str
    tier: str  # "nvme" | "object"
    removed: bool


@dataclass(frozen=True)
class StoreOutcome:
    written: int  # admitted to NVMe
    queued: int  # accepted for upload
    skipped: int  # already known here or remotely
    dropped: int  # not uploaded: queue full or store down


@dataclass(frozen=True)
class ShutdownReport:
    not_uploaded: list[str]


class TieredStore:
    def __init__(
        self,
        store: ObjectStore | None,
        cache: NVMeCache | None,
        *,
        codec: Codec = Codec.NONE,
        element_width: int = 2,
        upload_queue_bytes: int = 1 << 30,
        upload_workers: int = 8,
        io_workers: int = 16,
        admission_queue_bytes: int = 256 << 20,
        probe_hit_ttl_s: float = 600.0,
        probe_miss_ttl_s: float = 2.0,
        outage_cooldown_s: float = 5.0,
        metrics: EngineMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if store is None and cache is None:
            raise ConfigError("TieredStore needs an object store, an NVMe cache, or both")
        if upload_queue_bytes <= 0:
            raise ConfigError("upload_queue_bytes must be positive")
        self.store = store
        self.cache = cache
        self.codec = codec
        self.element_width = element_width
        self.metrics = metrics or EngineMetrics.for_registry()
        self._clock = clock
        self._cooldown = outage_cooldown_s
        self._down_until = 0.0
        self._probes = ProbeCache(probe_hit_ttl_s, probe_miss_ttl_s, clock=clock)
        self._probing: set[str] = set()
        self._lock = threading.Lock()
        self._events: deque[ChunkEvent] = deque(maxlen=_MAX_EVENTS)
        self._admission_budget = admission_queue_bytes
        self._admitting: set[str] = set()
        self._uploads = UploadQueue(upload_queue_bytes)
        self._io_workers = io_workers
        self._io = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="kvstore-io")
        self._stopping = threading.Event()
        self._upload_threads = [
            threading.Thread(target=self._upload_loop, name=f"kvstore-upload-{i}", daemon=True)
            for i in range(upload_workers if store is not None else 0)
        ]
        for thread in self._upload_threads:
            thread.start()
        if cache is not None:
            self.metrics.track_nvme_usage(lambda: _usage_pair(cache))

    # ---------------------------------------------------------------- lookup

    def lookup(self, keys: Sequence[str], *, wait: bool = True, probe: bool = True) -> list[Presence]:
        """Where each chunk can be loaded from. With `wait=False` unknown keys come back PENDING while a
        batched existence probe runs in the background (`probe=False`: the caller batches them itself
        through `probe_async`); call again to get the answer."""
        local = self.cache.contains_many(keys) if self.cache is not None else [False] * len(keys)
        out: list[Presence] = []
        unknown: list[int] = []
        store_usable = self.store is not None and self._store_available()
        for i, key in enumerate(keys):
            if local[i] or self._uploads.pending(key) is not None:
                out.append(Presence.LOCAL)
                continue
            known = self._probes.get(key) if store_usable else False
            if known is None:
                unknown.append(i)
                out.append(Presence.PENDING)
            else:
                out.append(Presence.REMOTE if known else Presence.MISS)
        if unknown:
            batch = [keys[i] for i in unknown]
            if wait:
                for i, present in zip(unknown, self._probe(batch), strict=True):
                    out[i] = Presence.REMOTE if present else Presence.MISS
            elif probe:
                self.probe_async(batch)
        self._count_lookup(out)
        return out

    def mark_missing(self, key: str) -> None:
        """Remember that `key` could not be loaded, so lookups answer MISS instead of promising it again."""
        self._probes.set(key, False)

    def _count_lookup(self, answers: list[Presence]) -> None:
        local = sum(1 for p in answers if p is Presence.LOCAL)
        remote = sum(1 for p in answers if p is Presence.REMOTE)
        missed = sum(1 for p in answers if p is Presence.MISS)
        if self.cache is not None:
            self.metrics.queries.labels("nvme").inc(
                len(answers) - sum(p is Presence.PENDING for p in answers)
            )
            self.metrics.hits.labels("nvme").inc(local)
        if self.store is not None and remote + missed:
            self.metrics.queries.labels("object").inc(remote + missed)
            self.metrics.hits.labels("object").inc(remote)

    def _probe(self, keys: Sequence[str]) -> list[bool]:
        assert self.store is not None
        try:
            found = self.store.exists_many(keys)
        except StoreError as exc:
            self._store_failed("exists", exc)
            return [False] * len(keys)
        for key, present in zip(keys, found, strict=True):
            self._probes.set(key, present)
        return found

    def probe_async(self, keys: Sequence[str]) -> None:
        """Ask the object store about `keys` in one background batch; answers land in the probe cache."""
        if self.store is None or not keys:
            return
        with self._lock:
            fresh = [k for k in keys if k not in self._probing]
            if not fresh or len(self._probing) + len(fresh) > _MAX_PENDING_PROBES:
                return  # already asked, or too much in flight: the caller retries
            self._probing.update(fresh)

        def run() -> None:
            try:
                self._probe(fresh)
            finally:
                with self._lock:
                    self._probing.difference_update(fresh)

        self._io.submit(run)

    # ------------------------------------------------------------------ load

    def load_into(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        """Fill each buffer with its chunk's raw bytes; True where the chunk was found and verified.
        Buffers whose entry is False may hold garbage and must not be used."""
        if len(items) <= 1:
            return [self._load_one(key, dest) for key, dest in items]
        # One task per worker over a stride of the batch: parallel I/O without a future per chunk.
        stride = min(self._io_workers, len(items))

        def run(first: int) -> list[bool]:
            return [self._load_one(key, dest) for key, dest in items[first::stride]]

        parts = [f.result() for f in [self._io.submit(run, i) for i in range(stride)]]
        out = [False] * len(items)
        for first, part in enumerate(parts):
            out[first::stride] = part
        return out

    def get(self, key: str) -> bytes | None:
        """A chunk's raw bytes (verified), or None. For tools; the vLLM path uses `load_into`."""
        if self.cache is not None:
            blob = self.cache.get(key)
            if blob is not None:
                try:
                    return decode(blob)
                except ChunkError as exc:
                    self._reject_nvme(key, exc)
        queued = self._uploads.pending(key)
        if queued is not None:
            return decode(queued)
        remote = self._fetch_remote(key)
        return None if remote is None else decode(remote)

    def _load_one(self, key: str, dest: memoryview) -> bool:
        if self.cache is not None and self._load_from_nvme(key, dest):
            return True
        queued = self._uploads.pending(key)
        if queued is not None:
            decode_into(queued, dest)  # our own fresh encoding; cannot be corrupt
            self.metrics.read_bytes.labels("memory").inc(len(dest.cast("B")))
            return True
        blob = self._fetch_remote(key, dest)
        return blob is not None

    def _load_from_nvme(self, key: str, dest: memoryview) -> bool:
        assert self.cache is not None
        located = self.cache.locate(key)
        if located is None:
            return False
        start = time.perf_counter()
        try:
            with open(located.path, "rb", buffering=0) as f:
                head = f.read(HEADER_SIZE)
                header = parse_header(head)
                if header.total_length != located.size:
                    raise ChunkFormatError("file length differs from the index")
                if header.codec is Codec.NONE:
                    out = dest.cast("B") if dest.ndim != 1 or dest.format != "B" else dest
                    if len(out) != header.raw_length:
                        raise ChunkFormatError("chunk size differs from the destination slot")
                    read_verified(f, out, header.checksum)
                else:
                    decode_into(head + f.read(), dest)
        except FileNotFoundError:
            # Evicted by another process after our index read, or lost: forget it if it is still indexed.
            self.cache.forget(key, located.path)
            return False
        except ChunkError as exc:
            self._reject_nvme(key, exc)
            return False
        except OSError as exc:
            log.warning("NVMe read of %s failed: %s", key, exc)
            self.metrics.load_failures.labels("nvme").inc()
            return False
        self.metrics.read_seconds.labels("nvme").observe(time.perf_counter() - start)
        self.metrics.read_bytes.labels("nvme").inc(header.raw_length)
        return True

    def _reject_nvme(self, key: str, exc: ChunkError) -> None:
        assert self.cache is not None
        log.warning("discarding corrupt NVMe chunk %s: %s", key, exc)
        self.metrics.checksum_failures.labels("nvme").inc()
        self.cache.discard(key)
        self._emit(key, "nvme", removed=True)

    def _fetch_remote(self, key: str, dest: memoryview | None = None) -> bytes | None:
        """GET a chunk, verify it (into `dest` when given) and admit it to NVMe in the background."""
        if self.store is None or not self._store_available():
            return None
        start = time.perf_counter()
        try:
            blob = self.store.get(key)
        except StoreError as exc:
            self._store_failed("get", exc)
            return None
        if blob is None:
            self._probes.set(key, False)
            self.metrics.load_failures.labels("object").inc()
            return None
        try:
            if dest is not None:
                decode_into(blob, dest)
            else:
                decode(blob)
        except ChunkError as exc:
            log.warning("deleting corrupt object %s: %s", key, exc)
            self.metrics.checksum_failures.labels("object").inc()
            self._probes.set(key, False)
            with contextlib.suppress(StoreError):
                self.store.delete(key)  # content-addressed: the next store of this prefix re-uploads it
            self._emit(key, "object", removed=True)
            return None
        self.metrics.read_seconds.labels("object").observe(time.perf_counter() - start)
        self.metrics.read_bytes.labels("object").inc(parse_header(blob).raw_length)
        self._probes.set(key, True)
        self._admit_in_background(key, blob)
        return blob

    def _admit_in_background(self, key: str, blob: bytes) -> None:
        if self.cache is None:
            return
        with self._lock:
            if key in self._admitting or len(blob) > self._admission_budget:
                return  # already on its way, or too much queued: the next hit tries again
            self._admitting.add(key)
            self._admission_budget -= len(blob)

        def run() -> None:
            try:
                self._write_nvme(key, blob)
            finally:
                with self._lock:
                    self._admitting.discard(key)
                    self._admission_budget += len(blob)

        self._io.submit(run)

    # ----------------------------------------------------------------- store

    def store_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> StoreOutcome:
        """Write chunks to NVMe now and queue them for upload. Returns once the caller's buffers may be
        reused (every byte needed later has been copied)."""
        written = queued = skipped = dropped = 0
        in_cache = self.cache.contains_many([k for k, _ in items]) if self.cache is not None else None
        for i, (key, raw) in enumerate(items):
            cached = in_cache[i] if in_cache is not None else False
            remote = self._probes.get(key) is True
            if cached or remote or self._uploads.pending(key) is not None:
                skipped += 1
                continue
            blob = encode(raw, self.codec, element_width=self.element_width)
            if self.cache is not None and self._write_nvme(key, blob):
                written += 1
            if self.store is None:
                continue
            if not self._store_available():
                self.metrics.stores_dropped.labels("store_down").inc()
                dropped += 1
            elif self._uploads.offer(key, blob):
                self.metrics.upload_queue_bytes.set(self._uploads.queued_bytes)
                queued += 1
            else:
                self.metrics.stores_dropped.labels("queue_full").inc()
                dropped += 1
        return StoreOutcome(written=written, queued=queued, skipped=skipped, dropped=dropped)

    def _write_nvme(self, key: str, blob: bytes) -> bool:
        assert self.cache is not None
        start = time.perf_counter()
        try:
            admitted = self.cache.put(key, blob)
        except (OSError, KVStoreError) as exc:
            log.warning("NVMe write of %s failed: %s", key, exc)
            self.metrics.load_failures.labels("nvme").inc()
            return False
        if admitted:
            self.metrics.write_seconds.labels("nvme").observe(time.perf_counter() - start)
            self.metrics.write_bytes.labels("nvme").inc(len(blob))
            self._emit(key, "nvme", removed=False)
        evicted = self.cache.take_evicted()
        if evicted:
            self.metrics.evictions.inc(len(evicted))
            for gone in evicted:
                self._emit(gone, "nvme", removed=True)
        return admitted

    def _upload_loop(self) -> None:
        assert self.store is not None
        while True:
            item = self._uploads.take(timeout=0.5)
            if item is None:
                if self._stopping.is_set():
                    return
                continue
            key, blob = item
            try:
                if not self._store_available():
                    self.metrics.stores_dropped.labels("store_down").inc()
                    continue
                start = time.perf_counter()
                self.store.put(key, blob)
                self.metrics.write_seconds.labels("object").observe(time.perf_counter() - start)
                self.metrics.write_bytes.labels("object").inc(len(blob))
                self._probes.set(key, True)
                self._emit(key, "object", removed=False)
            except StoreError as exc:
                self._store_failed("put", exc)
                self.metrics.stores_dropped.labels("error").inc()
            finally:
                self._uploads.done(key)
                self.metrics.upload_queue_bytes.set(self._uploads.queued_bytes)

    # -------------------------------------------------------- health, events

    def _store_available(self) -> bool:
        return self._clock() >= self._down_until

    def _store_failed(self, op: str, exc: StoreError) -> None:
        self.metrics.store_errors.labels(op).inc()
        if self._store_available():
            log.warning("object store %s failed (%s); serving from NVMe for %.0f s", op, exc, self._cooldown)
        self._down_until = self._clock() + self._cooldown
        self.metrics.object_store_up.set(0)

    @property
    def store_available(self) -> bool:
        return self.store is not None and self._store_available()

    def _emit(self, key: str, tier: str, *, removed: bool) -> None:
        self._events.append(ChunkEvent(key, tier, removed))

    def take_events(self) -> list[ChunkEvent]:
        """Events since the last call (oldest dropped past a bound if nobody takes them)."""
        out: list[ChunkEvent] = []
        while True:
            try:
                out.append(self._events.popleft())
            except IndexError:
                return out

    def touch(self, keys: Sequence[str]) -> None:
        if self.cache is not None:
            self.cache.touch(keys)

    @property
    def probes_in_flight(self) -> int:
        return len(self._probing)

    @property
    def upload_queue_bytes(self) -> int:
        return self._uploads.queued_bytes

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued upload has finished (or been dropped); False on timeout."""
        return self._uploads.wait_empty(timeout)

    def close(self, *, flush: bool = True, timeout: float = 30.0) -> ShutdownReport:
        """Stop the engine. With `flush`, waits up to `timeout` for uploads; reports what never made it."""
        if flush and self.store is not None and self._store_available():
            self._uploads.wait_empty(timeout)
        not_uploaded = self._uploads.close()
        self._stopping.set()
        for thread in self._upload_threads:
            thread.join(timeout)
        self._io.shutdown(wait=True, cancel_futures=True)
        if not_uploaded:
            log.warning("%d chunks were not uploaded before shutdown", len(not_uploaded))
        return ShutdownReport(not_uploaded=not_uploaded)


def _usage_pair(cache: NVMeCache) -> tuple[int, int]:
    usage = cache.usage()
    return usage.used_bytes, usage.budget_bytes
