"""The engine's I/O: functions that take their inputs and return result records, deciding nothing.

They run on the threads of ``kvstore.engine.threads``; the manager (``kvstore.engine.manager``) decides what
to do with what they return (answers, metrics, events, deletions, the breaker). A missing chunk and a bad
chunk are results; only the store's own failures (``StoreError``) and the cache's (``CacheError``) raise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvstore.cache import CachedChunk, NVMeCache, StagedFile
from kvstore.chunk import Buffer, ChunkHeader, Codec, decode_into, encode, payload_of, unpack_verified, verify
from kvstore.errors import CacheError, ChunkError, ChunkUnreadable, StoreError
from kvstore.stores import ObjectStore, get_each_located, get_located

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Fetched:
    """One GET: the object (None if the store has no such key), where it came from, and whether it is a
    good chunk for its key (``header``) or why not (``error``)."""

    key: str
    blob: Buffer | None
    region: str | None = None
    header: ChunkHeader | None = None
    error: ChunkError | None = None
    seconds: float = 0.0

    @property
    def good(self) -> bool:
        return self.header is not None


def fetch(store: ObjectStore, key: str) -> Fetched:
    """GET ``key`` and verify it as ``key``'s chunk (the payload is hashed in place, not copied)."""
    start = time.perf_counter()
    blob, region = get_located(store, key)
    return checked(key, blob, region, start)


def fetch_as_they_come(
    store: ObjectStore,
    next_item: Callable[[], tuple[_T, str] | None],
    on_fetched: Callable[[_T, Fetched], None],
    *,
    at_once: int,
    wanted: Callable[[_T], bool] = lambda _tag: True,
    on_found: Callable[[_T], None] | None = None,
) -> None:
    """`fetch` of the key of every ``(tag, key)`` that ``next_item`` hands out, ``at_once`` GETs in flight
    together on the calling thread (for a store whose ``gets_many_at_once``); each result to ``on_fetched``
    with its tag as it comes. ``wanted`` and ``on_found``: see `get_each_located`."""
    started: dict[_T, tuple[str, float]] = {}

    def next_timed() -> tuple[_T, str] | None:
        item = next_item()
        if item is not None:
            started[item[0]] = (item[1], time.perf_counter())
        return item

    def on_object(tag: _T, blob: Buffer | None, region: str | None) -> None:
        key, start = started.pop(tag)
        on_fetched(tag, checked(key, blob, region, start))

    get_each_located(store, next_timed, on_object, at_once=at_once, wanted=wanted, on_found=on_found)


def fetch_each(store: ObjectStore, keys: Sequence[str], *, at_once: int) -> list[Fetched]:
    """`fetch_as_they_come` of ``keys``, the results in the keys' order."""
    todo = iter(enumerate(keys))
    out: list[Fetched | None] = [None] * len(keys)

    def keep(i: int, fetched: Fetched) -> None:
        out[i] = fetched

    fetch_as_they_come(store, lambda: next(todo, None), keep, at_once=at_once)
    return [f if f is not None else Fetched(key, None) for key, f in zip(keys, out, strict=True)]


def checked(key: str, blob: Buffer | None, region: str | None, start: float) -> Fetched:
    """What a GET of ``key`` that began at ``start`` (``time.perf_counter``) brought, verified."""
    if blob is None:
        return Fetched(key, None, region, seconds=time.perf_counter() - start)
    try:
        header = verify(key, blob)
    except ChunkError as exc:
        return Fetched(key, blob, region, error=exc, seconds=time.perf_counter() - start)
    return Fetched(key, blob, region, header=header, seconds=time.perf_counter() - start)


def deliver(fetched: Fetched, dest: memoryview) -> ChunkError | None:
    """Copy a chunk that `fetch` verified into ``dest`` (memory speed, without the GIL, and not hashed
    again: the blob is immutable); the error if it cannot go there (another buffer size)."""
    assert fetched.header is not None and fetched.blob is not None
    header = fetched.header
    try:
        unpack_verified(header, payload_of(header, fetched.blob), dest)
    except ChunkError as exc:
        return exc
    return None


class NetworkBatch:
    """GETs of several chunks into their destinations on the io threads, with a deadline.

    At the deadline the batch is abandoned: GETs still on the wire finish on their own (the store's own
    timeouts end them), but their bytes are never copied into a destination, whose owner (vLLM) may reuse
    it the moment the job reports. A copy that started before the deadline is waited for; copies run at
    memory speed."""

    def __init__(self, store: ObjectStore, items: Sequence[tuple[str, memoryview]]) -> None:
        self._store = store
        self._items = items
        self._results: list[Fetched | None] = [None] * len(items)
        self._errors: list[StoreError | None] = [None] * len(items)
        self._cond = threading.Condition()
        self._copying = 0
        self._finished = 0
        self._abandoned = False

    def run(
        self, submit: Callable[[Callable[[], None]], object], workers: int, deadline: float
    ) -> tuple[list[Fetched | None], list[StoreError | None]]:
        """Results per item (None: not fetched in time), and the store errors met. ``workers`` GETs at once:
        on one task of the io pool where the store keeps many in flight on one thread, else on as many."""
        todo = iter(range(len(self._items)))
        if self._store.gets_many_at_once:
            runners = 1
            submit(lambda: self._runner(lambda: self._get_each(todo, workers)))
        else:
            runners = min(workers, len(self._items))
            for _ in range(runners):
                submit(lambda: self._runner(lambda: self._get_one_by_one(todo)))
        with self._cond:
            self._cond.wait_for(
                lambda: self._finished == runners, timeout=max(0.0, deadline - time.monotonic())
            )
            self._abandoned = True
            self._cond.wait_for(lambda: self._copying == 0)
            return list(self._results), list(self._errors)

    def _get_one_by_one(self, todo: Iterator[int]) -> None:
        for i in todo:
            if self._abandoned:
                return
            key = self._items[i][0]
            try:
                blob, region = get_located(self._store, key)
            except StoreError as exc:
                self._errors[i] = exc
                return  # the store is failing: the rest of the batch waits for nothing
            self._deliver(i, blob, region)

    def _get_each(self, todo: Iterator[int], at_once: int) -> None:
        def next_item() -> tuple[int, str] | None:
            i = next(todo, None)
            return None if i is None or self._abandoned else (i, self._items[i][0])

        try:
            get_each_located(
                self._store, next_item, self._deliver, at_once=at_once, wanted=lambda _i: not self._abandoned
            )
        except StoreError as exc:  # the store is failing: the rest of the batch waits for nothing
            unanswered = next((i for i, r in enumerate(self._results) if r is None), 0)
            self._errors[unanswered] = exc

    def _deliver(self, i: int, blob: Buffer | None, region: str | None) -> None:
        """Decode item ``i``'s object into its destination, unless the batch was abandoned."""
        with self._cond:
            if self._abandoned:
                return
            self._copying += 1
        key, dest = self._items[i]
        try:
            self._results[i] = _decode_fetched(key, blob, region, dest)
        finally:
            with self._cond:
                self._copying -= 1
                self._cond.notify_all()

    def _runner(self, get: Callable[[], None]) -> None:
        try:
            get()
        finally:
            with self._cond:
                self._finished += 1
                self._cond.notify_all()


def _decode_fetched(key: str, blob: Buffer | None, region: str | None, dest: memoryview) -> Fetched:
    if blob is None:
        return Fetched(key, None, region)
    try:
        return Fetched(key, blob, region, header=decode_into(key, blob, dest))
    except ChunkError as exc:
        return Fetched(key, blob, region, error=exc)


def write_chunk(
    cache: NVMeCache, key: str, raw: memoryview, codec: Codec, width: int
) -> StagedFile | CacheError:
    """Encode ``raw`` as ``key``'s chunk and write its file (straight from ``raw`` when uncompressed)."""
    try:
        chunk = encode(key, raw, codec, element_width=width)
        return cache.write_file(chunk.header, chunk.parts())
    except CacheError as exc:
        return exc


def write_fetched(cache: NVMeCache, fetched: Fetched) -> StagedFile | CacheError:
    """Write a verified object-store chunk as it came (its bytes are already the file's)."""
    assert fetched.header is not None and fetched.blob is not None
    try:
        return cache.write_file(fetched.header, [fetched.blob])
    except CacheError as exc:
        return exc


def upload(cache: NVMeCache, store: ObjectStore, located: CachedChunk) -> int:
    """PUT one queued chunk from its NVMe file; the bytes sent. FileNotFoundError if the file went (evicted
    meanwhile), another OSError if it cannot be read now, CacheError if it is torn or fails its check,
    ChunkUnreadable if this reader cannot check it (a newer format: never uploaded unchecked, never judged
    either), StoreError from the store."""
    blob = cache.read_stored(located)
    try:
        header = verify(located.key, blob)  # the bucket is shared: never PUT bytes that fail their check
    except ChunkUnreadable:
        raise
    except ChunkError as exc:
        raise CacheError(f"queued chunk {located.key} is damaged on NVMe: {exc}") from exc
    if header.checksum != located.checksum:
        raise CacheError(f"queued chunk {located.key} differs from its index entry")
    store.put(located.key, blob)
    return len(blob)
