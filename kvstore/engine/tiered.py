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
scheduler thread). Internal work runs on two small pools, `io` (object GETs and HEADs) and `upload`
(write-behind), and one `admit` thread that writes object hits to NVMe between loads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from kvstore.cache import CachedChunk, NVMeCache
from kvstore.chunk import (
    HEADER_SIZE,
    Codec,
    checksum,
    decode,
    decode_into,
    encode,
    parse_header,
)
from kvstore.engine.prefetch import PrefetchBuffer
from kvstore.engine.probes import AnswerCache, Presence
from kvstore.engine.uploads import UploadQueue
from kvstore.errors import (
    ChecksumMismatch,
    ChunkError,
    ChunkFormatError,
    ConfigError,
    KVStoreError,
    StoreError,
)
from kvstore.metrics import EngineMetrics
from kvstore.stores import ObjectStore, get_located

log = logging.getLogger(__name__)

_MAX_PENDING_PROBES = 65_536
# Batches up to this many bytes load from NVMe on the calling thread: memory-speed reads gain nothing from
# threads, and every extra thread multiplies GIL hand-offs with vLLM's scheduler. Larger batches fan out.
_SEQUENTIAL_MAX = 32 << 20
_MAX_EVENTS = 65_536
# Object hits are admitted to NVMe once loads and probes have been idle this long, or at the latest after
# the longer delay: on a node short of CPU, writing one request's chunks must not slow down the loads of the
# next one (or the end of its own).
_ADMIT_QUIET_S = 0.05
_ADMIT_MAX_DELAY_S = 1.0
_ADMIT_POLL_S = 0.01
_T = TypeVar("_T")


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
        prefetch_bytes: int = 256 << 20,
        probe_hit_ttl_s: float = 600.0,
        probe_miss_ttl_s: float = 2.0,
        local_ttl_s: float = 30.0,
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
        self._answers = AnswerCache(
            local_ttl_s=local_ttl_s, remote_ttl_s=probe_hit_ttl_s, miss_ttl_s=probe_miss_ttl_s, clock=clock
        )
        self._probe_requests: queue.SimpleQueue[list[list[str]]] = queue.SimpleQueue()
        self._probing: set[str] = set()
        self._touches: deque[Sequence[str]] = deque()
        self._lock = threading.Lock()
        self._events: deque[ChunkEvent] = deque(maxlen=_MAX_EVENTS)
        self._admission_budget = admission_queue_bytes
        self._admitting: set[str] = set()
        self._admissions: queue.SimpleQueue[list[tuple[str, bytes]] | None] = queue.SimpleQueue()
        self._loads_running = 0  # load_into calls in progress (under _lock)
        self._last_read = 0.0  # time.monotonic() when the last one ended
        self._prefetched = PrefetchBuffer(prefetch_bytes)
        self._uploads = UploadQueue(upload_queue_bytes)
        self._io_workers = io_workers
        self._io = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="kvstore-io")
        self._stopping = threading.Event()
        self._upload_threads = [
            threading.Thread(target=self._upload_loop, name=f"kvstore-upload-{i}", daemon=True)
            for i in range(upload_workers if store is not None else 0)
        ]
        self._prober = threading.Thread(target=self._probe_loop, name="kvstore-probe", daemon=True)
        self._admitter = threading.Thread(target=self._admit_loop, name="kvstore-admit", daemon=True)
        for thread in [*self._upload_threads, self._prober, self._admitter]:
            thread.start()
        self._m_queries = {t: self.metrics.queries.labels(t) for t in ("nvme", "object")}
        self._m_hits = {t: self.metrics.hits.labels(t) for t in ("nvme", "object")}
        self.metrics.prefetch_bytes.set_function(lambda: float(self._prefetched.held_bytes))
        if cache is not None:
            self.metrics.track_nvme_usage(lambda: _usage_pair(cache))

    # ---------------------------------------------------------------- lookup

    def lookup(self, keys: Sequence[str], *, wait: bool = True) -> list[Presence]:
        """Where each chunk can be loaded from, asking the index and (batched) the object store now.

        With `wait=False` unknown keys come back PENDING and are probed in the background. Tools use this;
        the vLLM scheduler uses `lookup_cached`, which never touches LMDB or the network.
        """
        local = self.cache.contains_many(keys) if self.cache is not None else [False] * len(keys)
        out: list[Presence] = []
        unknown: list[int] = []
        store_usable = self.store is not None and self._store_available()
        for i, key in enumerate(keys):
            if local[i] or self._uploads.pending(key) is not None:
                out.append(Presence.LOCAL)
                continue
            known = self._answers.get(key) if store_usable else Presence.MISS
            if known in (Presence.REMOTE, Presence.MISS):
                out.append(known)
            else:
                unknown.append(i)
                out.append(Presence.PENDING)
        if unknown:
            batch = [keys[i] for i in unknown]
            if wait:
                for i, present in zip(unknown, self._probe_store(batch), strict=True):
                    out[i] = Presence.REMOTE if present else Presence.MISS
            else:
                self.probe_async(batch)
        for answer in out:
            self._count(answer)
        return out

    def lookup_cached(self, key: str) -> Presence:
        """The scheduler's lookup: memory only, never blocks. PENDING: ask again after `probe_async`."""
        if self._uploads.pending(key) is not None:
            answer = Presence.LOCAL
        else:
            found = self._answers.get(key)
            if found is None:
                return Presence.PENDING
            answer = Presence.MISS if found is Presence.REMOTE and not self._store_available() else found
        self._count(answer)
        return answer

    def _count(self, answer: Presence) -> None:
        if answer is Presence.PENDING:
            return
        if self.cache is not None:
            self._m_queries["nvme"].inc()
            if answer is Presence.LOCAL:
                self._m_hits["nvme"].inc()
                return
        if self.store is not None:
            self._m_queries["object"].inc()
            if answer is Presence.REMOTE:
                self._m_hits["object"].inc()

    def mark_missing(self, key: str) -> None:
        """Remember that `key` could not be loaded, so lookups answer MISS instead of promising it again."""
        self._answers.set(key, Presence.MISS)

    def probe_async(self, keys: Sequence[str]) -> None:
        """Find out where `keys` are, in the background: the index first, then the object store, by GET when
        prefetching is on (a load is expected to follow), else by HEAD.
        Never blocks (the scheduler calls it)."""
        if keys:
            self._probe_requests.put([[key] for key in keys])

    def probe_prefixes(self, chains: Sequence[Sequence[str]]) -> None:
        """Like `probe_async`, for prefix lookups: a chain is the unknown keys of one request (and KV-cache
        group) in token order.

        A request can only use the chunks before its first miss, so when probing by GET the first key of
        every chain is asked first, and a chain stops at its first miss: the keys after it stay unanswered
        (asked again if anyone still wants them) instead of costing a request each. A request waits for the
        answer up to its first miss, not for the slowest of all its keys."""
        if chains:
            self._probe_requests.put([list(chain) for chain in chains if chain])

    @property
    def probes_in_flight(self) -> int:
        return len(self._probing) + self._probe_requests.qsize()

    def _probe_store(self, keys: Sequence[str]) -> list[bool]:
        if self.store is None or not self._store_available():
            return [False] * len(keys)
        try:
            found = self.store.exists_many(keys)
        except StoreError as exc:
            self._store_failed("exists", exc)
            return [False] * len(keys)
        for key, present in zip(keys, found, strict=True):
            self._answers.set(key, Presence.REMOTE if present else Presence.MISS)
        return found

    def _probe_loop(self) -> None:
        """The one thread that answers probes and applies buffered touches (off the scheduler thread)."""
        while not self._stopping.is_set():
            try:
                chains = self._probe_requests.get(timeout=0.2)
            except queue.Empty:
                self._apply_touches()
                continue
            pending = sum(map(len, chains))
            while pending < _MAX_PENDING_PROBES:
                try:
                    more = self._probe_requests.get_nowait()
                except queue.Empty:
                    break
                chains.extend(more)
                pending += sum(map(len, more))
            chains = self._unanswered(chains)
            self._probing.update(key for chain in chains for key in chain)
            try:
                self._answer(chains)
            except Exception:  # a probe must never kill the thread; unanswered keys are asked again
                log.exception("probe of %d chunks failed", len(self._probing))
            finally:
                self._probing.clear()
            self._apply_touches()

    def _unanswered(self, chains: list[list[str]]) -> list[list[str]]:
        """The chains with answered keys left out, each key in one chain only (its first)."""
        seen: set[str] = set()
        out: list[list[str]] = []
        for chain in chains:
            left = [k for k in dict.fromkeys(chain) if k not in seen and self._answers.get(k) is None]
            seen.update(left)
            if left:
                out.append(left)
        return out

    def _answer(self, chains: list[list[str]]) -> None:
        keys = [key for chain in chains for key in chain]
        here = self.cache.contains_many(keys) if self.cache is not None else [False] * len(keys)
        local = {key for key, cached in zip(keys, here, strict=True) if cached}
        for key in local:
            self._answers.set(key, Presence.LOCAL)
        elsewhere = [[k for k in chain if k not in local] for chain in chains]
        elsewhere = [chain for chain in elsewhere if chain]
        if not elsewhere:
            return
        if self.store is None or not self._store_available():
            for chain in elsewhere:
                for key in chain:
                    self._answers.set(key, Presence.MISS)
        elif self._prefetched.enabled:
            self._prefetch(elsewhere)
        else:
            self._probe_store([key for chain in elsewhere for key in chain])

    def _prefetch(self, chains: list[list[str]]) -> None:
        """Probe by GET: hits wait in the prefetch buffer for the load that follows (verified there).

        Keys are asked rank by rank over the chains (every chain's first key, then every second key...) and
        each answer is published as soon as its GET returns, so vLLM sees a growing prefix of hits and
        starts loading it while the rest is still on the wire. A chain stops at its first miss."""
        assert self.store is not None
        store = self.store
        order = [
            (c, rank)
            for rank in range(max(map(len, chains)))
            for c, chain in enumerate(chains)
            if rank < len(chain)
        ]
        first_miss = [len(chain) for chain in chains]

        def fetch(at: tuple[int, int]) -> bool:
            c, rank = at
            if rank > first_miss[c]:  # past a miss: this request cannot use it
                return False
            key = chains[c][rank]
            blob, region = get_located(store, key)
            if blob is None:
                first_miss[c] = min(first_miss[c], rank)
                self._answers.set(key, Presence.MISS)
                return False
            self._prefetched.offer(key, blob, region)  # no room: still a hit, the load GETs it again
            self._answers.set(key, Presence.REMOTE)
            return True

        try:
            self._map_parallel(fetch, order)
        except StoreError as exc:  # keys answered before the failure stand; the rest are asked again
            self._store_failed("get", exc)

    def _apply_touches(self) -> None:
        if self.cache is None:
            return
        keys: list[str] = []  # may stay empty: touch() then just writes out buffered touches once due
        while self._touches:
            keys.extend(self._touches.popleft())
        try:
            self.cache.touch(keys)
        except KVStoreError as exc:
            log.warning("could not record %d touches: %s", len(keys), exc)

    # ------------------------------------------------------------------ load

    def load_into(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        """Fill each buffer with its chunk's raw bytes; True where the chunk was found and verified.
        Buffers whose entry is False may hold garbage and must not be used."""
        with self._lock:
            self._loads_running += 1
        try:
            return self._load_into(items)
        finally:
            with self._lock:
                self._loads_running -= 1
                self._last_read = time.monotonic()

    def _load_into(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        start = time.perf_counter()
        # One index read for the whole batch: each LMDB transaction hands the GIL away once.
        where = (
            self.cache.locate_many([k for k, _ in items]) if self.cache is not None else [None] * len(items)
        )
        located = dict(zip((k for k, _ in items), where, strict=True))

        def load_local(key: str, dest: memoryview) -> bool:
            return self._load_local(key, dest, located[key])

        if len(items) > 1 and sum(len(d.cast("B")) for _, d in items) > _SEQUENTIAL_MAX:
            out = self._in_parallel(items, range(len(items)), load_local)
        else:
            out = [load_local(key, dest) for key, dest in items]
        hits = sum(out)
        if hits and self.cache is not None:
            self._touches.append([key for (key, _), ok in zip(items, out, strict=True) if ok])
        if hits:  # metrics once per batch: the per-chunk loop stays as short as possible
            per_chunk = (time.perf_counter() - start) / len(items)
            nvme_seconds = self.metrics.read_seconds.labels("nvme")
            for _ in range(hits):
                nvme_seconds.observe(per_chunk)
            self.metrics.read_bytes.labels("nvme").inc(
                sum(len(d.cast("B")) for (_, d), ok in zip(items, out, strict=True) if ok)
            )
        missing = [i for i, ok in enumerate(out) if not ok]
        if self.store is None or not missing:
            return out
        # What the probe already fetched is in memory: verify and copy it here, at memory speed. Only the
        # rest waits on the network, and on the io workers, which may still be busy with that probe's GETs.
        fetched: list[tuple[str, bytes]] = []
        on_network: list[int] = []
        for i in missing:
            key, dest = items[i]
            held = self._prefetched.take(key)
            if held is None:
                on_network.append(i)
                continue
            blob = self._accept_remote(key, held[0], held[1], dest, since=start)
            if blob is not None:
                fetched.append((key, blob))
                out[i] = True

        def fetch_into(key: str, dest: memoryview) -> bool:
            blob = self._fetch_remote(key, dest, admit=False)
            if blob is not None:
                fetched.append((key, blob))  # list.append is atomic
            return blob is not None

        if len(on_network) == 1 and self._store_available():
            out[on_network[0]] = fetch_into(*items[on_network[0]])
        elif on_network and self._store_available():  # several GETs: spread them over the io workers
            for i, ok in zip(on_network, self._in_parallel(items, on_network, fetch_into), strict=True):
                out[i] = ok
        # One background batch for NVMe (one index commit, not one per chunk on the load's critical path).
        self._admit_in_background(fetched)
        return out

    def _in_parallel(
        self,
        items: Sequence[tuple[str, memoryview]],
        indices: Sequence[int],
        load: Callable[[str, memoryview], bool],
    ) -> list[bool]:
        """`load` over `items[indices]` on the io workers."""
        return self._map_parallel(lambda i: load(*items[i]), indices)

    def _map_parallel(self, fn: Callable[[_T], bool], args: Sequence[_T]) -> list[bool]:
        """`fn` over `args` on the io workers, which take the items in order (no future per item)."""
        out = [False] * len(args)
        todo = iter(range(len(args)))  # shared: a range iterator hands each index to one worker

        def run() -> None:
            for i in todo:
                out[i] = fn(args[i])

        for future in [self._io.submit(run) for _ in range(min(self._io_workers, len(args)))]:
            future.result()
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

    def _load_local(self, key: str, dest: memoryview, located: CachedChunk | None) -> bool:
        """From NVMe (where the index said it is), or from the upload queue; False if neither has the chunk
        (or it failed to verify)."""
        if located is not None and self._load_from_nvme(located, dest):
            return True
        queued = self._uploads.pending(key)
        if queued is None:
            return False
        decode_into(queued, dest)  # our own fresh encoding; cannot be corrupt
        return True

    def _load_from_nvme(self, located: CachedChunk, dest: memoryview) -> bool:
        assert self.cache is not None
        key = located.key
        try:
            out = dest.cast("B") if dest.ndim != 1 or dest.format != "B" else dest
            head = bytearray(HEADER_SIZE)
            # One open and one preadv per chunk: every syscall hands the GIL away, and taking it back from
            # vLLM's busy scheduler thread can cost milliseconds, so the fast path makes as few as it can.
            fd = os.open(located.path, os.O_RDONLY)
            try:
                got = os.preadv(fd, [head, out], 0)
                header = parse_header(head)
                if header.total_length != located.size:
                    raise ChunkFormatError("file length differs from the index")
                if header.codec is Codec.NONE:
                    if header.raw_length != len(out):
                        raise ChunkFormatError("chunk size differs from the destination slot")
                    if got != HEADER_SIZE + len(out):
                        raise ChunkFormatError("truncated chunk file")
                    elif checksum(out) != header.checksum:
                        raise ChecksumMismatch("NVMe copy failed verification")
                else:
                    payload = os.pread(fd, header.payload_length, HEADER_SIZE)
                    decode_into(bytes(head) + payload, dest)
            finally:
                os.close(fd)
        except FileNotFoundError:
            # Evicted by another process after our index read, or lost: forget it if it is still indexed.
            self.cache.forget(key, located.path)
            self._answers.forget(key)
            return False
        except ChunkError as exc:
            self._reject_nvme(key, exc)
            return False
        except OSError as exc:
            log.warning("NVMe read of %s failed: %s", key, exc)
            self.metrics.load_failures.labels("nvme").inc()
            return False
        return True

    def _reject_nvme(self, key: str, exc: ChunkError) -> None:
        assert self.cache is not None
        log.warning("discarding corrupt NVMe chunk %s: %s", key, exc)
        self.metrics.checksum_failures.labels("nvme").inc()
        self.cache.discard(key)
        self._answers.forget(key)
        self._emit(key, "nvme", removed=True)

    def _fetch_remote(self, key: str, dest: memoryview | None = None, *, admit: bool = True) -> bytes | None:
        """GET a chunk (unless the probe prefetched it), verify it (into `dest` when given) and, with
        `admit`, admit it to NVMe in the background."""
        if self.store is None:
            return None
        start = time.perf_counter()
        blob: bytes | None
        held = self._prefetched.take(key)
        if held is not None:
            blob, region = held
        elif not self._store_available():
            return None
        else:
            try:
                blob, region = get_located(self.store, key)
            except StoreError as exc:
                self._store_failed("get", exc)
                return None
        blob = self._accept_remote(key, blob, region, dest, since=start)
        if blob is not None and admit:
            self._admit_in_background([(key, blob)])
        return blob

    def _accept_remote(
        self, key: str, blob: bytes | None, region: str | None, dest: memoryview | None, *, since: float
    ) -> bytes | None:
        """Verify an object-store copy (decoding it into `dest` when given): the blob if it is good, None if
        it is missing or corrupt (a corrupt object is deleted, so it is never served)."""
        assert self.store is not None
        if blob is None:
            self._answers.set(key, Presence.MISS)
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
            self._answers.set(key, Presence.MISS)
            with contextlib.suppress(StoreError):
                self.store.delete(key)  # content-addressed: the next store of this prefix re-uploads it
            self._emit(key, "object", removed=True)
            return None
        self.metrics.read_seconds.labels("object").observe(time.perf_counter() - since)
        self.metrics.read_bytes.labels("object").inc(parse_header(blob).raw_length)
        if region is not None:  # several regions: which one served it (counted once verified)
            self.metrics.region_hits.labels(region).inc()
        if self._answers.get(key) is not Presence.LOCAL:
            self._answers.set(key, Presence.REMOTE)
        return blob

    def _admit_in_background(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Queue verified object hits for NVMe, within the admission budget (see `_admit_loop`)."""
        if self.cache is None or not items:
            return
        batch: list[tuple[str, bytes]] = []
        with self._lock:
            for key, blob in items:
                if key in self._admitting or len(blob) > self._admission_budget:
                    continue  # already on its way, or too much queued: the next hit tries again
                self._admitting.add(key)
                self._admission_budget -= len(blob)
                batch.append((key, blob))
        if batch:
            self._admissions.put(batch)

    def _admit_loop(self) -> None:
        """Write queued object hits to NVMe, one index commit for all that is queued, at a quiet moment:
        when no load or probe has run for `_ADMIT_QUIET_S` (or after `_ADMIT_MAX_DELAY_S` at the latest).
        At close, what is queued is written at once."""
        while (batch := self._admissions.get()) is not None:
            deadline = time.monotonic() + _ADMIT_MAX_DELAY_S
            while self._reading() and time.monotonic() < deadline and not self._stopping.is_set():
                time.sleep(_ADMIT_POLL_S)
            closing = False
            while not closing:
                try:
                    more = self._admissions.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    closing = True
                else:
                    batch.extend(more)
            try:
                self._write_nvme(batch)
            except Exception:  # the thread must outlive any one batch; these hits are simply not cached
                log.exception("NVMe admission of %d chunks failed", len(batch))
            finally:
                with self._lock:
                    for key, blob in batch:
                        self._admitting.discard(key)
                        self._admission_budget += len(blob)
            if closing:
                return

    def _reading(self) -> bool:
        """Whether a load or a probe is running, or one ended less than `_ADMIT_QUIET_S` ago."""
        if self._loads_running or self.probes_in_flight:
            self._last_read = time.monotonic()
            return True
        return time.monotonic() - self._last_read < _ADMIT_QUIET_S

    # ----------------------------------------------------------------- store

    def store_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> StoreOutcome:
        """Write chunks to NVMe now and queue them for upload. Returns once the caller's buffers may be
        reused (every byte needed later has been copied)."""
        queued = skipped = dropped = 0
        in_cache = self.cache.contains_many([k for k, _ in items]) if self.cache is not None else None
        fresh: list[tuple[str, bytes | memoryview]] = []
        for i, (key, raw) in enumerate(items):
            cached = in_cache[i] if in_cache is not None else False
            remote = self._answers.get(key) is Presence.REMOTE
            if cached or remote or self._uploads.pending(key) is not None:
                skipped += 1
                continue
            blob = encode(raw, self.codec, element_width=self.element_width)
            fresh.append((key, blob))
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
        written = sum(self._write_nvme(fresh)) if self.cache is not None and fresh else 0
        return StoreOutcome(written=written, queued=queued, skipped=skipped, dropped=dropped)

    def _write_nvme(self, items: Sequence[tuple[str, bytes | memoryview]]) -> list[bool]:
        """Admit chunks to NVMe as one batch (one index commit); per chunk, whether it was admitted."""
        assert self.cache is not None
        start = time.perf_counter()
        try:
            admitted = self.cache.put_many(items)
        except (OSError, KVStoreError) as exc:
            log.warning("NVMe write of %d chunks failed: %s", len(items), exc)
            self.metrics.load_failures.labels("nvme").inc()
            return [False] * len(items)
        per_chunk = (time.perf_counter() - start) / len(items)
        for (key, blob), ok in zip(items, admitted, strict=True):
            if ok:
                self._answers.set(key, Presence.LOCAL)
                self.metrics.write_seconds.labels("nvme").observe(per_chunk)
                self.metrics.write_bytes.labels("nvme").inc(len(blob))
                self._emit(key, "nvme", removed=False)
        evicted = self.cache.take_evicted()
        if evicted:
            self.metrics.evictions.inc(len(evicted))
            for gone in evicted:
                self._answers.forget(gone)
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
                if self._answers.get(key) is not Presence.LOCAL:
                    self._answers.set(key, Presence.REMOTE)
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
        """Mark chunks used; applied in the background, so the scheduler never waits on the index."""
        if self.cache is not None:
            self._touches.append(keys)

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
        self._admissions.put(None)  # after what is queued: those hits are still written
        for thread in [*self._upload_threads, self._prober, self._admitter]:
            thread.join(timeout)
        self._apply_touches()
        self._io.shutdown(wait=True, cancel_futures=True)
        if not_uploaded:
            log.warning("%d chunks were not uploaded before shutdown", len(not_uploaded))
        return ShutdownReport(not_uploaded=not_uploaded)


def _usage_pair(cache: NVMeCache) -> tuple[int, int]:
    usage = cache.usage()
    return usage.used_bytes, usage.budget_bytes
