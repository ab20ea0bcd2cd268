"""The object-store contract every backend implements: bytes under '/'-separated keys.

Keys are relative to the store's own prefix (a bucket prefix, a directory, a memory namespace). A missing key
is a return value (`None`, `False`), never an exception; an unusable store raises one of the typed errors in
`kvstore.errors` (`StoreUnavailable`, `StoreAuthError`, `BucketNotFound`, `StoreError`), translated by each
backend at its own edge. Every method is blocking and safe to call from several threads at once.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeAlias, TypeVar

__all__ = ["Buffer", "Data", "ObjectInfo", "ObjectStore", "as_bytes_view", "check_range", "validate_key"]

# What `put` accepts: callers hand over slices of big buffers without copying them first.
Data: TypeAlias = bytes | bytearray | memoryview
# What `get_chunk` returns: anything with the buffer protocol (bytes, or a client's own response buffer).
Buffer: TypeAlias = bytes | bytearray | memoryview | Any

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One listed object: its key relative to the store, its size and its modification time."""

    key: str
    size: int
    last_modified: float  # seconds since the epoch, UTC


def validate_key(key: str) -> str:
    """Return `key` if it is a well-formed relative key, else raise `ValueError` (a caller bug, not I/O).

    Rejecting empty, absolute and dot segments keeps every backend (a directory tree in particular) from
    escaping its root or aliasing two spellings of one object.
    """
    if not key or key.startswith("/") or key.endswith("/"):
        raise ValueError(f"invalid store key {key!r}: must be non-empty and not start or end with '/'")
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise ValueError(f"invalid store key {key!r}: empty, '.' or '..' segment")
    if "\x00" in key:
        raise ValueError(f"invalid store key {key!r}: NUL character")
    return key


def check_range(start: int, length: int) -> None:
    """Reject negative ranges up front; every backend shares the same rule."""
    if start < 0 or length < 0:
        raise ValueError(f"invalid range start={start} length={length}: both must be >= 0")


def as_bytes_view(data: Data) -> memoryview:
    """A flat byte view of `data` (no copy); multi-byte or strided views are a caller bug."""
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("put needs C-contiguous data")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class ObjectStore(abc.ABC):
    """A flat key -> bytes store (S3 semantics), used by the cache, GC, pins and the admin tools.

    Contract shared by all backends:
    - `put` overwrites; identical concurrent writes of content-addressed data are harmless.
    - `put_if_absent` is create-only and atomic: exactly one of several racing writers gets `True`.
    - readers never observe a partially written object.
    - `list` streams keys in ascending order (byte order of the UTF-8 key), page by page. One known
      deviation: SeaweedFS's S3 API orders segment by segment ("a/b" before "a-c"); consistent with its own
      `start_after`, so paging works, but callers must not assume byte order across a '/' boundary.
    """

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """A URL naming this store (`s3://bucket/prefix`, `file:///dir`, `memory://name`), never a secret."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The object's bytes, or `None` if it does not exist."""

    def get_chunk(self, key: str) -> Buffer | None:
        """The object as a buffer, for the data path: a backend may hand out its own memory instead of a
        copy (obstore's response body). Same semantics as `get` otherwise."""
        return self.get(key)

    def reserve_bodies(self, length: int, count: int) -> int:
        """Have memory for ``count`` GET bodies of ``length`` bytes mapped ahead of a burst of reads (a
        new node's first loads), where this backend reads into memory of its own; slow: call it on a thread
        of its own. Returns the bytes mapped; here none."""
        return 0

    # Whether `get_each` keeps many GETs in flight on the calling thread (else callers spread `get_chunk`
    # calls over threads of their own).
    gets_many_at_once = False

    def get_each(
        self,
        next_item: Callable[[], tuple[_T, str] | None],
        on_object: Callable[[_T, Buffer | None], None],
        *,
        at_once: int,
        on_found: Callable[[_T], None] | None = None,
    ) -> None:
        """`get_chunk` of the key of every ``(tag, key)`` that ``next_item`` hands out until it says None,
        each answer given to ``on_object`` with its tag as it comes, all on the calling thread. ``next_item``
        is asked each time a GET can start, so it may skip what became useless meanwhile; while GETs are in
        flight, its None means none now (an answer may give it more), and it is asked again after the next
        answer. Here, one after the other; a backend that speaks to a server keeps up to ``at_once`` in
        flight. ``on_found(tag)``, where a backend can tell, as soon as the server says the object exists,
        before its bytes have come (a hint: ``on_object`` still gives the answer)."""
        while (item := next_item()) is not None:
            tag, key = item
            on_object(tag, self.get_chunk(key))

    @abc.abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        """Bytes `[start, start + length)` of the object, shorter (maybe empty) past its end.

        `None` if the object is missing."""

    @abc.abstractmethod
    def put(self, key: str, data: Data) -> None:
        """Write the object, replacing any previous version atomically."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: Data) -> bool:
        """Create the object only if no object has the key; `True` if this call created it."""

    @abc.abstractmethod
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """For each key, in order, whether the object exists. Backends batch or parallelise the probes."""

    def exists(self, key: str) -> bool:
        """Whether one object exists."""
        return self.exists_many([key])[0]

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error."""

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove several objects; backends with a batch API override this."""
        for key in keys:
            self.delete(key)

    @abc.abstractmethod
    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Stream the objects whose key starts with `prefix` (a plain string prefix, not only a directory),
        in ascending key order, beginning after `start_after` if given. Never loads the whole listing."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise `BucketNotFound`, `StoreAuthError` or `StoreUnavailable` if the store cannot be used."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release connections and threads. The store must not be used afterwards; closing it again is
        harmless (a no-op)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
