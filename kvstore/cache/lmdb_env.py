"""The NVMe cache index's LMDB environment: opened once per process, its schema and data file checked.

LMDB forbids opening one environment twice in a process, so environments are shared through a process-wide
registry keyed by real path (``acquire``/``release``). After ``fork`` the child keeps using the inherited
handle: py-lmdb refuses a second handle on the same files, and closing the inherited one would run
``mdb_env_close``, which clears the *parent's* reader slots. The one cost: the child's readers are recorded
under the parent's pid, so a reader slot of a child killed mid-read is reclaimed only when the parent exits.
Prefer 'spawn' for workers.

A damaged index is refused at open with a `CacheError` (`fsck --fix` rebuilds it from the self-describing
chunk files): a data file shorter than its own meta pages say would otherwise crash the process with SIGBUS
on the first read of a missing page (``check_data_file``).
"""

from __future__ import annotations

import functools
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import lmdb

from kvstore.errors import CacheError

__all__ = [
    "DEFAULT_MAP_SIZE",
    "INDEX_DIR",
    "SCHEMA_VERSION",
    "Shared",
    "acquire",
    "check_data_file",
    "is_open_in_this_process",
    "read_schema_version",
    "release",
    "translate",
]

SCHEMA_VERSION = 2
INDEX_DIR = "index"
DEFAULT_MAP_SIZE = 64 << 30  # sparse: LMDB only grows the file as pages are used
_U64 = struct.Struct("<Q")
_SCHEMA_KEY = b"schema_version"
_DB_NAMES = (b"entries", b"lru", b"pins", b"uploads", b"meta", b"counters", b"changes")

_P = ParamSpec("_P")
_R = TypeVar("_R")


def translate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Map LMDB's exceptions to CacheError at this module's edge."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except lmdb.Error as exc:
            raise CacheError(f"cache index error: {exc}") from exc

    return wrapper


@dataclass
class Shared:
    env: lmdb.Environment
    entries: lmdb._Database
    lru: lmdb._Database
    pins: lmdb._Database
    uploads: lmdb._Database
    meta: lmdb._Database
    counters: lmdb._Database
    changes: lmdb._Database
    pid: int
    refs: int = 0


REGISTRY: dict[str, Shared] = {}
REGISTRY_LOCK = threading.Lock()


def _open_shared(path: str, map_size: int, max_readers: int, sync: bool) -> Shared:
    os.makedirs(path, exist_ok=True)
    check_data_file(path)
    # metasync off: one fsync per commit instead of two. LMDB still flushes a commit's pages before its meta
    # page, so a crash can lose the last commit but never leaves a torn index.
    env = lmdb.open(path, map_size=map_size, max_dbs=8, max_readers=max_readers, sync=sync, metasync=False)
    try:
        # Reader slots of SIGKILLed processes would otherwise pin old pages forever.
        env.reader_check()
        entries, lru, pins, uploads, meta, counters, changes = (env.open_db(name) for name in _DB_NAMES)
        shared = Shared(
            env=env,
            entries=entries,
            lru=lru,
            pins=pins,
            uploads=uploads,
            meta=meta,
            counters=counters,
            changes=changes,
            pid=os.getpid(),
        )
        _check_schema(shared, path)
    except BaseException:
        env.close()
        raise
    return shared


def _check_schema(shared: Shared, path: str) -> None:
    with shared.env.begin() as txn:
        raw = txn.get(_SCHEMA_KEY, db=shared.meta)
    if raw is None:
        with shared.env.begin(write=True) as txn:
            if txn.get(_SCHEMA_KEY, db=shared.meta) is not None:
                return  # another process initialised it between our two transactions
            if txn.stat(shared.entries)["entries"]:
                # Entries but no version: an index from before versioning, whose counters and LRU order
                # may be missing. Stamping it here would skip the migration that rebuilds them.
                raise CacheError(
                    f"cache index {path!r} predates schema versioning; run `kvstore migrate` first"
                )
            txn.put(_SCHEMA_KEY, _U64.pack(SCHEMA_VERSION), db=shared.meta)
        return
    version = _U64.unpack(raw)[0]
    if version > SCHEMA_VERSION:
        raise CacheError(
            f"cache index {path!r} has schema version {version}, newer than this kvstore supports "
            f"({SCHEMA_VERSION}); upgrade kvstore or point the cache at another directory"
        )
    if version < SCHEMA_VERSION:
        raise CacheError(
            f"cache index {path!r} has schema version {version}; run `kvstore migrate` to upgrade it "
            f"to {SCHEMA_VERSION}"
        )


# LMDB's meta pages (pages 0 and 1): a 16-byte page header, then MDB_meta. Only the fields needed to know
# how long the data file must be: magic, the last page used, and the transaction id that says which of the
# two metas is current. See lmdb.h / mdb.c (MDB_meta); stable since LMDB 0.9.
_MDB_MAGIC = 0xBEEFC0DE
_META = struct.Struct("<IIQQ")  # mm_magic, mm_version, mm_address, mm_mapsize
_META_AT = 16
_DB_RECORD = 48  # sizeof(MDB_db) on 64-bit builds
_LAST_PAGE_AT = _META_AT + _META.size + 2 * _DB_RECORD
_TAIL = struct.Struct("<QQ")  # mm_last_pg, mm_txnid


def check_data_file(path: str) -> None:
    """CacheError if ``<path>/data.mdb`` is damaged in a way LMDB would only find by crashing: a file shorter
    than the pages its current meta page says are in use (a truncated file, or torn meta pages). Reads the
    two meta pages with plain file I/O, before LMDB maps anything."""
    data = os.path.join(path, "data.mdb")
    try:
        size = os.path.getsize(data)
    except FileNotFoundError:
        return  # a new index
    if size == 0:
        return  # created but never committed: LMDB initialises it
    with open(data, "rb") as f:
        head = f.read(2 * 65536)
    page_size = _page_size(head)
    metas: list[tuple[int, int]] = []
    for start in (0, page_size):
        page = head[start : start + page_size]
        if len(page) < _LAST_PAGE_AT + _TAIL.size:
            continue
        magic = _META.unpack_from(page, _META_AT)[0]
        if magic == _MDB_MAGIC:
            last_page, txn = _TAIL.unpack_from(page, _LAST_PAGE_AT)
            metas.append((txn, last_page))
    if not metas:
        raise CacheError(
            f"cache index {path!r} is damaged (no valid LMDB meta page); run `kvstore fsck --fix` to rebuild "
            "it from the chunk files"
        )
    _, last_page = max(metas)
    if (last_page + 1) * page_size > size:
        raise CacheError(
            f"cache index {path!r} is damaged: data.mdb is {size} bytes but its pages reach "
            f"{(last_page + 1) * page_size}; run `kvstore fsck --fix` to rebuild it from the chunk files"
        )


def _page_size(head: bytes) -> int:
    """The page size LMDB used, from the first meta page (``mm_psize`` lives in the free DB's ``md_pad``),
    or from where a second meta page is found when the first is damaged."""
    if len(head) >= _LAST_PAGE_AT and _META.unpack_from(head, _META_AT)[0] == _MDB_MAGIC:
        psize = int.from_bytes(head[_META_AT + _META.size : _META_AT + _META.size + 4], "little")
        if psize in (4096, 8192, 16384, 32768, 65536):
            return psize
    for candidate in (4096, 8192, 16384, 32768, 65536):
        page = head[candidate : candidate + _META_AT + _META.size]
        if len(page) == _META_AT + _META.size and _META.unpack_from(page, _META_AT)[0] == _MDB_MAGIC:
            return candidate
    return 4096


def acquire(path: str, map_size: int, max_readers: int, sync: bool) -> Shared:
    with REGISTRY_LOCK:
        shared = REGISTRY.get(path)
        if shared is None:
            shared = _open_shared(path, map_size, max_readers, sync)
            REGISTRY[path] = shared
        shared.refs += 1
        return shared


def release(path: str, shared: Shared) -> None:
    with REGISTRY_LOCK:
        shared.refs -= 1
        if shared.refs <= 0:
            if REGISTRY.get(path) is shared:
                del REGISTRY[path]
            if shared.pid == os.getpid():  # never in a forked child: see the module docstring
                shared.env.close()


def is_open_in_this_process(directory: str | os.PathLike[str]) -> bool:
    """Whether this process holds the index of the cache at `directory` open (one handle per process)."""
    return os.path.realpath(os.path.join(directory, INDEX_DIR)) in REGISTRY


def read_schema_version(env: lmdb.Environment) -> int:
    """The schema version an index records (0 before versioning), read through a handle of the caller's."""
    meta = env.open_db(b"meta")
    with env.begin() as txn:
        raw = txn.get(_SCHEMA_KEY, db=meta)
    return 0 if raw is None else int(_U64.unpack(raw)[0])
