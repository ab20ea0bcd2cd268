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

import errno
import functools
import logging
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import lmdb

from kvstore.cache import index_flush
from kvstore.cache.index_flush import IndexFlusher
from kvstore.cache.lmdb_check import check_data_file
from kvstore.errors import CacheError, CacheFull

__all__ = [
    "DEFAULT_MAP_SIZE",
    "INDEX_DIR",
    "SCHEMA_VERSION",
    "Shared",
    "acquire",
    "check_data_file",
    "get_u64",
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
_DB_NAMES = (
    b"entries",
    b"lru",
    b"pins",
    b"uploads",
    b"meta",
    b"counters",
    b"changes",
    b"unlinks",
    b"claims",
    b"adrift",
)
# Room for the tables of later releases: a handle needs a slot for each table it opens.
_MAX_DBS = 16

# py-lmdb reports a failed write as "<call>: <strerror>" (lmdb.DiskError), without the errno.
_NO_SPACE_MESSAGES = {os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT)}

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def get_u64(txn: lmdb.Transaction, key: bytes, db: lmdb._Database) -> int:
    """A little-endian 64-bit count stored under ``key`` (every counter of the index is one), 0 if absent."""
    raw = txn.get(key, db=db)
    return 0 if raw is None else int(_U64.unpack(raw)[0])


def translate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Map LMDB's exceptions to CacheError at this module's edge (CacheFull for a full disk: a commit could
    not write its pages)."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except lmdb.Error as exc:
            error = CacheFull if _NO_SPACE_MESSAGES.intersection(str(exc).split(": ")) else CacheError
            raise error(f"cache index error: {exc}") from exc

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
    unlinks: lmdb._Database
    claims: lmdb._Database
    adrift: lmdb._Database
    pid: int
    refs: int = 0
    flusher: IndexFlusher | None = None  # None: LMDB syncs each commit itself


REGISTRY: dict[str, Shared] = {}
REGISTRY_LOCK = threading.Lock()


def _open_shared(path: str, map_size: int, max_readers: int, flush_s: float) -> Shared:
    """``flush_s`` > 0: commits are flushed together that often (`index_flush`); 0: LMDB syncs each one."""
    os.makedirs(path, mode=0o700, exist_ok=True)  # the index names every chunk: its owner's alone
    boot = index_flush.boot_id()
    # Every opener, whatever its own flushes: another process's may have been cut short by a machine crash.
    reaped = index_flush.check_markers(path, boot) if boot is not None else []
    check_data_file(path)
    marker = ""
    if boot is not None and flush_s > 0:
        try:
            marker = index_flush.leave_marker(path, boot)
        except OSError as exc:  # a full disk: no commit of ours may then go unflushed
            log.warning("cache index %s: each commit syncs (no flush marker: %s)", path, exc)
    # Syncing each commit, metasync off: one fsync per commit instead of two. LMDB still flushes a commit's
    # pages before its meta page, so a crash can lose the last commit but never leaves a torn index.
    env = lmdb.open(
        path,
        map_size=map_size,
        max_dbs=_MAX_DBS,
        max_readers=max_readers,
        sync=not marker,
        metasync=False,
        mode=0o600,
    )
    try:
        # Reader slots of SIGKILLed processes would otherwise pin old pages forever.
        env.reader_check()
        # In a write transaction of our own: py-lmdb's default opens each database in one it begins itself,
        # and waits there for the index's write lock *holding the GIL*, so a process stopped inside a write
        # transaction (a hung node agent) froze every thread of every process that opened the cache.
        with env.begin(write=True) as txn:
            db = {name.decode(): env.open_db(name, txn=txn) for name in _DB_NAMES}
        shared = Shared(
            env=env,
            entries=db["entries"],
            lru=db["lru"],
            pins=db["pins"],
            uploads=db["uploads"],
            meta=db["meta"],
            counters=db["counters"],
            changes=db["changes"],
            unlinks=db["unlinks"],
            claims=db["claims"],
            adrift=db["adrift"],
            pid=os.getpid(),
        )
        _check_schema(shared, path)
        if marker:
            shared.flusher = IndexFlusher(env, flush_s, marker)
        if reaped:
            index_flush.reap(env, reaped)
    except BaseException:
        flushed = index_flush.sync(env) if marker else False
        env.close()
        if flushed:
            os.unlink(marker)
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


def acquire(path: str, map_size: int, max_readers: int, flush_s: float) -> Shared:
    """This process's handle on the index at ``path``; the first opener's ``flush_s`` holds for all."""
    with REGISTRY_LOCK:
        shared = REGISTRY.get(path)
        if shared is None:
            shared = _open_shared(path, map_size, max_readers, flush_s)
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
                if shared.flusher is not None:
                    shared.flusher.close()
                shared.env.close()


def is_open_in_this_process(directory: str | os.PathLike[str]) -> bool:
    """Whether this process holds the index of the cache at `directory` open (one handle per process)."""
    return os.path.realpath(os.path.join(directory, INDEX_DIR)) in REGISTRY


def read_schema_version(env: lmdb.Environment) -> int:
    """The schema version an index records (0 before versioning), read through a handle of the caller's."""
    with env.begin(write=True) as txn:  # not open_db's own: it waits for the write lock holding the GIL
        meta = env.open_db(b"meta", txn=txn)
        raw = txn.get(_SCHEMA_KEY, db=meta)
    return 0 if raw is None else int(_U64.unpack(raw)[0])
