"""Several regions behind one store: the local region read-write, remote regions as read-only fallbacks.

Reads of chunk objects (`*.bin` keys outside `_meta/`) try the local region first and then, only for what
is missing there, the remote regions in their configured order. Everything else (writes, listings, deletes,
and every meta object: pins, leases, access records, GC reports, namespace configs) acts on the local region
alone, so GC, pins and leases stay per region and no remote is ever written.

Remote reads never stall the local path:
- a local hit never touches a remote;
- each remote runs on a small thread pool of its own, and a caller waits at most `timeout_s` (one deadline
  per call, shared by the remotes) before the answer is "missing";
- a remote that fails or misses the deadline is skipped for `cooldown_s` (a circuit breaker), so a dead
  region costs nothing per request. `kvstore:region_errors{region}` counts each failure.

A remote hit is copied into the local region in the background: one copy per key at a time (an in-flight
set), create-only (`put_if_absent`, so a key already local is left alone), within a byte budget (over it the
copy is skipped and the next hit tries again), and only once the chunk has verified against its checksum,
so a corrupt remote object is never copied. `kvstore:region_copies{region}` counts copies by source region.
`get_located` tells the caller which region served a read; the engine counts `kvstore:region_hits` with it
after the bytes have verified.

Batches (`get_each_located`) keep the local region's GETs in flight together as its store does, then ask the
remotes, one after the other, for what it lacked: each remote's GETs in flight together on one of its own
threads, under the same shared deadline, asking the caller before each GET whether the key is still wanted
(a request cannot use a chunk past its first miss).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from typing_extensions import override

from kvstore.chunk import verify
from kvstore.errors import ChunkError, ConfigError, StoreError
from kvstore.layout import is_chunk_key
from kvstore.metrics import EngineMetrics
from kvstore.stores.base import Buffer, Data, ObjectInfo, ObjectStore

__all__ = ["RegionalStore", "get_each_located", "get_located"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def get_located(store: ObjectStore, key: str) -> tuple[Buffer | None, str | None]:
    """`store.get_chunk(key)` plus the name of the region that answered (None for a single-region store)."""
    if isinstance(store, RegionalStore):
        return store.get_located(key)
    return store.get_chunk(key), None


def get_each_located(
    store: ObjectStore,
    next_item: Callable[[], tuple[_T, str] | None],
    on_object: Callable[[_T, Buffer | None, str | None], None],
    *,
    at_once: int,
    wanted: Callable[[_T], bool] = lambda _tag: True,
    on_found: Callable[[_T], None] | None = None,
) -> None:
    """`store.get_each` with the name of the region that answered each key (None for a single-region store).
    ``wanted(tag)`` is asked before a remote region is asked for a key the local region lacked; ``on_found``
    hears of the local region's objects only (see `ObjectStore.get_each`)."""
    if isinstance(store, RegionalStore):
        store.get_each_located(next_item, on_object, at_once=at_once, wanted=wanted, on_found=on_found)
    else:
        store.get_each(
            next_item, lambda tag, blob: on_object(tag, blob, None), at_once=at_once, on_found=on_found
        )


def _exists_many(store: ObjectStore, keys: Sequence[str]) -> list[bool]:
    return store.exists_many(keys)


class _Remote:
    """One remote region: its store, its own threads, and a circuit breaker."""

    def __init__(self, name: str, store: ObjectStore, workers: int) -> None:
        self.name = name
        self.store = store
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"kvstore-region-{name}")
        self.down_until = 0.0


class RegionalStore(ObjectStore):
    """`local` (read-write) plus `remotes` (name, store) read in order when the local region misses.

    The store owns its regions: `close()` closes them all. `clock` drives the cooldown only (tests inject
    one); deadlines are real time.
    """

    def __init__(
        self,
        local: ObjectStore,
        remotes: Sequence[tuple[str, ObjectStore]],
        *,
        local_name: str = "local",
        timeout_s: float = 1.5,
        cooldown_s: float = 30.0,
        workers: int = 4,
        copy_queue_bytes: int = 256 << 20,
        copy_workers: int = 2,
        metrics: EngineMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        names = [local_name, *(name for name, _ in remotes)]
        if len(set(names)) != len(names):
            raise ConfigError(f"store_url: region names must be unique, got {', '.join(names)}")
        if timeout_s <= 0 or cooldown_s <= 0 or workers < 1 or copy_workers < 1 or copy_queue_bytes < 0:
            raise ConfigError("regions: timeout, cooldown and worker counts must be positive")
        self._local = local
        self.gets_many_at_once = local.gets_many_at_once  # batches go the local region's way
        self.local_name = local_name
        self._remotes = [_Remote(name, store, workers) for name, store in remotes]
        self._timeout = timeout_s
        self._cooldown = cooldown_s
        self._clock = clock
        self.metrics = metrics or EngineMetrics.for_registry()
        self._copier = ThreadPoolExecutor(max_workers=copy_workers, thread_name_prefix="kvstore-region-copy")
        self._copy_budget = copy_queue_bytes
        self._copying: set[str] = set()
        self._copies_idle = threading.Condition()
        self._closed = False

    # -- identity --

    @property
    @override
    def url(self) -> str:
        return self._local.url

    @property
    def local(self) -> ObjectStore:
        return self._local

    @override
    def reserve_bodies(self, length: int, count: int) -> int:
        return self._local.reserve_bodies(length, count)  # a remote region's hits are the rare case

    @property
    def regions(self) -> list[str]:
        """Region names, local first, in the order they are read."""
        return [self.local_name, *(r.name for r in self._remotes)]

    def region_stores(self) -> list[tuple[str, ObjectStore]]:
        """(name, store) of every region, local first."""
        return [(self.local_name, self._local), *((r.name, r.store) for r in self._remotes)]

    def remote_available(self, name: str) -> bool:
        """False while the remote `name` sits out a cooldown after a failure."""
        return self._clock() >= self._remote(name).down_until

    def _remote(self, name: str) -> _Remote:
        for remote in self._remotes:
            if remote.name == name:
                return remote
        raise KeyError(name)

    @override
    def __repr__(self) -> str:
        remotes = ", ".join(f"{r.name}={r.store.url}" for r in self._remotes)
        return f"RegionalStore({self.local_name}={self._local.url!r}, remotes=[{remotes}])"

    # -- reads: local first, remotes for what is missing --

    def get_located(self, key: str) -> tuple[Buffer | None, str | None]:
        """The object's bytes and the name of the region that had them, or (None, None)."""
        blob = self._local.get_chunk(key)
        if blob is not None:
            return blob, self.local_name
        if not is_chunk_key(key):
            return None, None
        deadline = time.monotonic() + self._timeout
        for remote in self._remotes:
            found = self._ask(remote, deadline, lambda store: store.get_chunk(key))
            if found is not None:
                self._copy_later(key, found, remote.name)
                return found, remote.name
        return None, None

    @override
    def get_each(
        self,
        next_item: Callable[[], tuple[_T, str] | None],
        on_object: Callable[[_T, Buffer | None], None],
        *,
        at_once: int,
        on_found: Callable[[_T], None] | None = None,
    ) -> None:
        self.get_each_located(
            next_item, lambda tag, blob, _region: on_object(tag, blob), at_once=at_once, on_found=on_found
        )

    def get_each_located(
        self,
        next_item: Callable[[], tuple[_T, str] | None],
        on_object: Callable[[_T, Buffer | None, str | None], None],
        *,
        at_once: int,
        wanted: Callable[[_T], bool] = lambda _tag: True,
        on_found: Callable[[_T], None] | None = None,
    ) -> None:
        """`get_each`, each answer with the region that had the key: the local region's answers as they
        come, then what it lacked from the remotes (see the module's doc). ``on_found`` hears of the local
        region's objects only: a remote's answer comes after the local region's GETs have all ended."""
        missed: list[tuple[_T, str]] = []

        def next_local() -> tuple[tuple[_T, str], str] | None:
            item = next_item()
            return None if item is None else (item, item[1])

        def on_local(item: tuple[_T, str], blob: Buffer | None) -> None:
            tag, key = item
            if blob is not None:
                on_object(tag, blob, self.local_name)
            elif self._remotes and is_chunk_key(key):
                missed.append(item)
            else:
                on_object(tag, None, None)

        def found_local(item: tuple[_T, str]) -> None:
            if on_found is not None:
                on_found(item[0])

        self._local.get_each(next_local, on_local, at_once=at_once, on_found=found_local)
        deadline = time.monotonic() + self._timeout
        for n, remote in enumerate(self._remotes, start=1):
            if not missed:
                return
            last = n == len(self._remotes)
            missed = self._get_each_remote(remote, missed, on_object, at_once, wanted, deadline, last)
        for tag, _key in missed:
            on_object(tag, None, None)

    def _get_each_remote(
        self,
        remote: _Remote,
        items: list[tuple[_T, str]],
        on_object: Callable[[_T, Buffer | None, str | None], None],
        at_once: int,
        wanted: Callable[[_T], bool],
        deadline: float,
        last: bool,
    ) -> list[tuple[_T, str]]:
        """Ask ``remote`` for ``items`` by ``deadline``. Its answers go to ``on_object`` as they come (so
        ``wanted`` sees what they changed): its hits, and its misses when no region is left to ask. What
        was not answered (a miss with regions left, a key not wanted or not asked in time) is returned."""
        lock = threading.Lock()
        ended = False  # set at the deadline: a late answer is dropped, not delivered after we returned
        answered = [False] * len(items)
        todo = iter(range(len(items)))

        def next_item() -> tuple[int, str] | None:
            for i in todo:
                if ended:
                    return None
                if wanted(items[i][0]):
                    return i, items[i][1]
            return None

        def on_answer(i: int, blob: Buffer | None) -> None:
            if blob is None and not last:
                return
            tag, key = items[i]
            with lock:
                if ended:
                    return
                answered[i] = True
                on_object(tag, blob, None if blob is None else remote.name)
            if blob is not None:
                self._copy_later(key, blob, remote.name)

        self._ask(remote, deadline, lambda store: store.get_each(next_item, on_answer, at_once=at_once))
        with lock:
            ended = True
        return [item for item, done in zip(items, answered, strict=True) if not done]

    @override
    def get(self, key: str) -> bytes | None:
        blob = self.get_located(key)[0]
        return None if blob is None else bytes(blob)

    @override
    def get_chunk(self, key: str) -> Buffer | None:
        return self.get_located(key)[0]

    @override
    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        data = self._local.get_range(key, start, length)
        if data is not None or not is_chunk_key(key):
            return data
        deadline = time.monotonic() + self._timeout
        for remote in self._remotes:
            data = self._ask(remote, deadline, lambda store: store.get_range(key, start, length))
            if data is not None:
                return data  # a part of an object is not verifiable, so it is not copied
        return None

    @override
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        found = self._local.exists_many(keys)
        deadline = time.monotonic() + self._timeout
        for remote in self._remotes:
            missing = [i for i, (key, here) in enumerate(zip(keys, found, strict=True)) if not here]
            missing = [i for i in missing if is_chunk_key(keys[i])]
            if not missing:
                break
            asked = [keys[i] for i in missing]
            # Bind this round's keys: a call that outlives the deadline must not see the next round's.
            answer = self._ask(remote, deadline, functools.partial(_exists_many, keys=asked))
            if answer is None:
                continue
            for i, present in zip(missing, answer, strict=True):
                found[i] = present
        return found

    def _ask(self, remote: _Remote, deadline: float, call: Callable[[ObjectStore], _T]) -> _T | None:
        """`call(remote.store)` on the remote's threads, or None if the remote is cooling down, fails or
        does not answer by `deadline`. Never raises: a remote region is a best-effort fallback."""
        if self._closed or self._clock() < remote.down_until:
            return None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None  # an earlier remote used the whole deadline; not this one's fault
        try:
            future: Future[_T] = remote.pool.submit(call, remote.store)
        except RuntimeError:  # the pool shut down under us (close); nothing to ask
            return None
        try:
            return future.result(timeout=remaining)
        except TimeoutError:
            if future.cancel():
                return None  # still queued behind our own busy threads: a miss, but not the remote's fault
            # A running call ends on the store's own timeouts; its late answer is dropped.
            self._remote_failed(remote, f"no answer within {self._timeout:.2f} s")
        except StoreError as exc:
            self._remote_failed(remote, str(exc))
        return None

    def _remote_failed(self, remote: _Remote, why: str) -> None:
        self.metrics.region_errors.labels(remote.name).inc()
        if self._clock() >= remote.down_until:
            log.warning("region %s failed (%s); skipping it for %.0f s", remote.name, why, self._cooldown)
        remote.down_until = self._clock() + self._cooldown

    # -- background copies into the local region --

    def _copy_later(self, key: str, blob: Buffer, source: str) -> None:
        with self._copies_idle:
            if self._closed or key in self._copying or len(blob) > self._copy_budget:
                return  # already on its way, or too much in flight: the next hit tries again
            self._copying.add(key)
            self._copy_budget -= len(blob)
        try:
            self._copier.submit(self._copy, key, blob, source)
        except RuntimeError:  # closed between the check and the submit
            self._copy_done(key, len(blob))

    def _copy(self, key: str, blob: Buffer, source: str) -> None:
        try:
            try:
                verify(key, blob)  # before the local region vouches for these bytes
            except ChunkError as exc:
                log.warning("not copying %s from region %s: %s", key, source, exc)
                return
            if self._local.put_if_absent(key, blob):
                self.metrics.region_copies.labels(source).inc()
        except StoreError as exc:
            log.warning("copy of %s from region %s into %s failed: %s", key, source, self.local_name, exc)
        except Exception:  # a copy is an optimisation: log it, never kill the worker
            log.exception("copy of %s from region %s failed", key, source)
        finally:
            self._copy_done(key, len(blob))

    def _copy_done(self, key: str, size: int) -> None:
        with self._copies_idle:
            self._copying.discard(key)
            self._copy_budget += size
            if not self._copying:
                self._copies_idle.notify_all()

    def wait_copies(self, timeout: float = 30.0) -> bool:
        """Wait until no copy is in flight; False on timeout (tests and orderly shutdown use it)."""
        with self._copies_idle:
            return self._copies_idle.wait_for(lambda: not self._copying, timeout)

    # -- everything else: the local region only --

    @override
    def put(self, key: str, data: Data) -> None:
        self._local.put(key, data)

    @override
    def put_if_absent(self, key: str, data: Data) -> bool:
        return self._local.put_if_absent(key, data)

    @override
    def delete(self, key: str) -> None:
        self._local.delete(key)

    @override
    def delete_many(self, keys: Sequence[str]) -> None:
        self._local.delete_many(keys)

    @override
    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[ObjectInfo]:
        return self._local.list(prefix, start_after)

    @override
    def check(self) -> None:
        # Only the local region must work; a remote that is down is skipped when read.
        self._local.check()

    @override
    def close(self) -> None:
        with self._copies_idle:
            if self._closed:
                return  # the first close closed every region's store
            self._closed = True
        self._copier.shutdown(wait=True, cancel_futures=True)
        for remote in self._remotes:
            # A call stuck on a slow remote ends on the store's own timeouts; do not wait for it here.
            remote.pool.shutdown(wait=False, cancel_futures=True)
            remote.store.close()
        self._local.close()
