"""Checking an LMDB data file before LMDB maps it: a damaged one would crash the process (SIGBUS) on the
first read of a page past the file's end, instead of failing in a way the cache can report.

LMDB's meta pages (pages 0 and 1) say which pages are in use: the current one (the higher transaction id)
names the last page (``mm_last_pg``) and the roots of the main and the free DB. A file shorter than that is
not necessarily damaged: pages a transaction allocated at the end of the file and freed again before it
committed ("loose" pages) are never written, only listed in the free DB. So the pages past the end must all
be free ones; the free DB is read with plain file I/O to tell (it is a few pages). Layout from lmdb.h / mdb.c
(MDB_meta, MDB_db, MDB_page, MDB_node, 64-bit builds), stable since LMDB 0.9.
"""

from __future__ import annotations

import os
import struct

from kvstore.errors import CacheError

__all__ = ["check_data_file"]

_MDB_MAGIC = 0xBEEFC0DE
_META = struct.Struct("<IIQQ")  # mm_magic, mm_version, mm_address, mm_mapsize
_META_AT = 16  # after the page header
_DB_RECORD = 48  # sizeof(MDB_db)
_ROOT_AT = 40  # md_root's offset in MDB_db
_FREE_ROOT_AT = _META_AT + _META.size + _ROOT_AT  # mm_dbs[FREE_DBI].md_root
_LAST_PAGE_AT = _META_AT + _META.size + 2 * _DB_RECORD
_TAIL = struct.Struct("<QQ")  # mm_last_pg, mm_txnid
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")
_PAGE_FLAGS = struct.Struct("<HH")  # mp_flags, mp_lower (after mp_pgno and mp_pad)
_NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
_PAGE_HEADER = 16
_P_BRANCH, _P_LEAF = 0x01, 0x02
_F_BIGDATA = 0x01  # a leaf node whose data lives on overflow pages
_NO_PAGE = (1 << 64) - 1  # P_INVALID: an empty DB's root
_MAX_FREE_DB_PAGES = 100_000  # a free DB larger than this (or a cycle of pages) is not one LMDB wrote


def check_data_file(path: str) -> None:
    """CacheError if ``<path>/data.mdb`` is damaged in a way LMDB would only find by crashing: no valid meta
    page, or pages in use past the end of the file (a truncated file, torn meta pages)."""
    data = os.path.join(path, "data.mdb")
    try:
        size = os.path.getsize(data)
    except FileNotFoundError:
        return  # a new index
    if size == 0:
        return  # created but never committed: LMDB initialises it
    fd = os.open(data, os.O_RDONLY)
    try:
        head = os.pread(fd, 2 * 65536, 0)
        page_size = _page_size(head)
        metas: list[tuple[int, int, int]] = []
        for start in (0, page_size):
            page = head[start : start + page_size]
            if len(page) < _LAST_PAGE_AT + _TAIL.size or _META.unpack_from(page, _META_AT)[0] != _MDB_MAGIC:
                continue
            last_page, txn = _TAIL.unpack_from(page, _LAST_PAGE_AT)
            metas.append((txn, last_page, _U64.unpack_from(page, _FREE_ROOT_AT)[0]))
        if not metas:
            raise CacheError(
                f"cache index {path!r} is damaged (no valid LMDB meta page); run `kvstore fsck --fix` to "
                "rebuild it from the chunk files"
            )
        _, last_page, free_root = max(metas)
        pages = size // page_size
        if last_page >= pages and not _all_free(fd, page_size, pages, free_root, range(pages, last_page + 1)):
            raise CacheError(
                f"cache index {path!r} is damaged: data.mdb is {size} bytes but its pages reach "
                f"{(last_page + 1) * page_size}; run `kvstore fsck --fix` to rebuild it from the chunk files"
            )
    finally:
        os.close(fd)


def _all_free(fd: int, page_size: int, pages: int, root: int, wanted: range) -> bool:
    """Whether the free DB rooted at ``root`` lists every page of ``wanted``, reading only pages that lie
    within the file's ``pages``."""
    free: set[int] = set()
    stack = [] if root == _NO_PAGE else [root]
    seen: set[int] = set()
    while stack:
        pgno = stack.pop()
        if pgno >= pages or pgno in seen or len(seen) >= _MAX_FREE_DB_PAGES:
            return False
        seen.add(pgno)
        page = os.pread(fd, page_size, pgno * page_size)
        flags, lower = _PAGE_FLAGS.unpack_from(page, 10)
        for i in range((lower - _PAGE_HEADER) >> 1):
            at = _U16.unpack_from(page, _PAGE_HEADER + 2 * i)[0]
            lo, hi, node_flags, ksize = _NODE.unpack_from(page, at)
            if flags & _P_BRANCH:
                stack.append(lo | hi << 16 | node_flags << 32)
            elif flags & _P_LEAF:
                data_at = at + _NODE.size + ksize
                free.update(_page_list(fd, page, data_at, lo | hi << 16, node_flags, page_size))
    return all(p in free for p in wanted)


def _page_list(fd: int, page: bytes, at: int, size: int, node_flags: int, page_size: int) -> tuple[int, ...]:
    """The page numbers of one free DB record (an MDB_IDL: a count, then the pages), inline or on overflow
    pages."""
    if node_flags & _F_BIGDATA:
        overflow = _U64.unpack_from(page, at)[0]
        data = os.pread(fd, size, overflow * page_size + _PAGE_HEADER)
    else:
        data = page[at : at + size]
    if len(data) < _U64.size:
        return ()
    count = min(_U64.unpack_from(data)[0], (len(data) - _U64.size) // _U64.size)
    return struct.unpack_from(f"<{count}Q", data, _U64.size)


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
