"""An in-process store: a locked dict, for tests and for single-process experiments."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator, Sequence

from typing_extensions import override

from kvstore.stores.base import Data, ObjectInfo, ObjectStore, as_bytes_view, check_range, validate_key

__all__ = ["MemoryStore"]

# Listing copies this many entries under the lock at a time, so writers are never blocked for long.
_LIST_PAGE = 1000


class MemoryStore(ObjectStore):
    """Objects kept in a dict; thread-safe, nothing survives the process."""

    def __init__(self, name: str = "") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._objects: dict[str, tuple[bytes, float]] = {}

    @property
    @override
    def url(self) -> str:
        return f"memory://{self._name}"

    @override
    def get(self, key: str) -> bytes | None:
        validate_key(key)
        with self._lock:
            entry = self._objects.get(key)
        return None if entry is None else entry[0]

    @override
    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        check_range(start, length)
        data = self.get(key)
        return None if data is None else data[start : start + length]

    @override
    def put(self, key: str, data: Data) -> None:
        validate_key(key)
        value = bytes(as_bytes_view(data))  # copy: the caller may reuse its buffer
        with self._lock:
            self._objects[key] = (value, time.time())

    @override
    def put_if_absent(self, key: str, data: Data) -> bool:
        validate_key(key)
        value = bytes(as_bytes_view(data))
        with self._lock:
            if key in self._objects:
                return False
            self._objects[key] = (value, time.time())
            return True

    @override
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            validate_key(key)
        with self._lock:
            return [key in self._objects for key in keys]

    @override
    def delete(self, key: str) -> None:
        validate_key(key)
        with self._lock:
            self._objects.pop(key, None)

    @override
    def delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            validate_key(key)
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)

    @override
    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[ObjectInfo]:
        cursor = start_after if start_after is not None and start_after >= prefix else None
        while True:
            with self._lock:
                # Sorting per page keeps the code simple; the memory store is not for big listings.
                keys = sorted(k for k in self._objects if k.startswith(prefix))
                begin = 0 if cursor is None else bisect.bisect_right(keys, cursor)
                page = [
                    ObjectInfo(k, len(self._objects[k][0]), self._objects[k][1])
                    for k in keys[begin : begin + _LIST_PAGE]
                ]
            yield from page
            if len(page) < _LIST_PAGE:
                return
            cursor = page[-1].key

    @override
    def check(self) -> None:
        return None
