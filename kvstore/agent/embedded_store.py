"""The agent's embedded object store, following whichever server runs for the node's data directory now.

The embedded SeaweedFS server belongs to the process that started it: usually the first engine on the node,
which stops it when it exits, while the agent it started lives on (and a later engine starts another server,
on other ports). An agent that kept its first endpoint would PUT to a dead one for good. `FollowedStore`
asks, every so often (`follow`, from the agent process's main thread), which server runs now, starting one
if none does, and from then on sends every call there. Calls in flight on the old endpoint fail as an outage
does: the uploads retry.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence

from kvstore.errors import KVStoreError
from kvstore.stores import ObjectInfo, ObjectStore
from kvstore.stores.base import Buffer, Data
from kvstore.stores.embedded import SeaweedServer

__all__ = ["FollowedStore"]

log = logging.getLogger(__name__)

Opener = Callable[[], tuple[ObjectStore, SeaweedServer | None]]


class FollowedStore(ObjectStore):
    """An `ObjectStore` whose calls go to the embedded server that runs now (see the module docstring)."""

    def __init__(self, store: ObjectStore, server: SeaweedServer, reopen: Opener) -> None:
        self._store = store
        self._server = server
        self._reopen = reopen
        self._lock = threading.Lock()
        self._retired: list[tuple[ObjectStore, SeaweedServer]] = []

    @property
    def endpoint(self) -> str:
        return self._server.endpoint

    def follow(self) -> bool:
        """Move to the server that runs now, if it is not the one in use (starting one if none runs); whether
        it moved. Blocks while a server starts: call it from a thread that nothing else waits on."""
        try:
            store, server = self._reopen()
        except (KVStoreError, OSError) as exc:  # OSError: a server's files on a full disk, say
            log.warning("the embedded object store is not available: %s", exc)
            return False
        if server is None or server.endpoint == self._server.endpoint:
            store.close()
            if server is not None and server is not self._server:
                server.stop()  # a handle on the same server: stopping it leaves the server running
            return False
        log.info("the embedded object store moved: %s -> %s", self._server.endpoint, server.endpoint)
        with self._lock:
            old = (self._store, self._server)
            self._store, self._server = store, server
        # Closed at the end, not now: a thread may be in a call on it (it fails as a request to a dead server
        # does, and is retried).
        self._retired.append(old)
        return True

    def _current(self) -> ObjectStore:
        with self._lock:
            return self._store

    @property
    def url(self) -> str:
        return self._current().url

    def get(self, key: str) -> bytes | None:
        return self._current().get(key)

    def get_chunk(self, key: str) -> Buffer | None:
        return self._current().get_chunk(key)

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        return self._current().get_range(key, start, length)

    def put(self, key: str, data: Data) -> None:
        self._current().put(key, data)

    def put_if_absent(self, key: str, data: Data) -> bool:
        return self._current().put_if_absent(key, data)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return self._current().exists_many(keys)

    def delete(self, key: str) -> None:
        self._current().delete(key)

    def delete_many(self, keys: Sequence[str]) -> None:
        self._current().delete_many(keys)

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[ObjectInfo]:
        return self._current().list(prefix, start_after)

    def check(self) -> None:
        self._current().check()

    def close(self) -> None:
        """Close every store used, and stop the servers this process started (another's are left alone)."""
        with self._lock:
            stores = [*self._retired, (self._store, self._server)]
            self._retired = []
        for store, server in stores:
            with contextlib.suppress(KVStoreError):
                store.close()
            server.stop()
