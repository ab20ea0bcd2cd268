"""``NVMeCache.evict`` (the node agent keeps usage under the budget with it) and ``make_room`` (the store
path's way out of a full disk): down to the target, least recently used first, uploaded chunks before those
still waiting for upload, pinned chunks never; chunks lost before their upload counted by reason."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvstore.cache import NVMeCache
from kvstore.chunk import stored_size
from tests.cache_helpers import admit, cached_keys, evicted_since, locate

U = stored_size(100)


def k(i: int) -> str:
    return f"llama_abc123def456_r0/abc/de_g0/{i:064x}.bin"


def fill(cache: NVMeCache, keys: range, *, pending_upload: bool = False) -> None:
    for i in keys:
        assert admit(cache, k(i), bytes([i]) * 100, pending_upload=pending_upload)


def files(cache_dir: Path) -> int:
    return sum(1 for p in (cache_dir / "chunks").rglob("*") if p.is_file())


def test_evict_goes_down_to_the_target_least_recently_used_first(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10 * U) as cache:
        fill(cache, range(10))
        cache.touch([k(1)])
        cache.touch([k(0)])
        cache.flush()  # LRU order now: 2..9, 1, 0
        seq = cache.change_seq()
        assert cache.evict(10 * U) == [], "already there"
        assert cache.evict(6 * U) == [k(2), k(3), k(4), k(5)]
        assert cache.used_bytes() == 6 * U and cache.usage().entries == 6
        assert cache.evict(6 * U - 1) == [k(6)], "one byte over: one chunk more, no further"
        assert cache.used_bytes() == 5 * U
        assert cache.evict(-1) == [k(7), k(8), k(9), k(1), k(0)]
        assert cache.usage().entries == 0 and cached_keys(cache) == []
        assert files(cache_dir) == 0, "victims' files are unlinked"
        assert evicted_since(cache, seq) == [k(i) for i in (2, 3, 4, 5, 6, 7, 8, 9, 1, 0)]
        removals = cache.take_removals()
        assert removals.evicted == 10 and removals.lost_uploads == {}
        assert cache.fsck().clean


def test_evict_takes_uploaded_chunks_before_those_waiting_for_upload(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10 * U) as cache:
        fill(cache, range(0, 2), pending_upload=True)  # the oldest, and their only copies
        fill(cache, range(2, 4))
        fill(cache, range(4, 5), pending_upload=True)
        assert cache.evict(3 * U) == [k(2), k(3)], "uploaded ones first, though younger"
        assert cache.take_removals().lost_uploads == {}
        assert cache.backlog().chunks == 3
        assert cache.evict(U, keep_pending=True) == [], "nothing uploaded is left, and the rest is kept"
        assert cache.take_removals().lost_uploads == {}
        # Nothing uploaded is left: the oldest waiting ones go, and are counted lost.
        assert cache.evict(U) == [k(0), k(1)]
        assert cache.take_removals().lost_uploads == {"evicted": 2}
        assert cache.backlog().chunks == 1
        assert [c.key for c in cache.claim_uploads(10)] == [k(4)]


def test_evict_never_takes_pinned_chunks(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10 * U) as cache:
        fill(cache, range(6))
        cache.pin([k(0), k(3)])
        cache.pin([k(3)])
        assert sorted(cache.evict(0)) == sorted([k(1), k(2), k(4), k(5)])
        assert sorted(cached_keys(cache)) == sorted([k(0), k(3)])
        assert cache.used_bytes() == 2 * U, "above the target: only pinned chunks are left"
        assert cache.evict(0) == []
        cache.unpin([k(0), k(3)])
        assert cache.evict(0) == [k(0)], "k(3) still has a pin"


def test_lost_uploads_are_counted_by_reason(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10 * U) as cache:
        fill(cache, range(6), pending_upload=True)
        fill(cache, range(6, 7))
        assert cache.evict(6 * U) == [k(6)]  # uploaded: not lost
        assert cache.evict(5 * U) == [k(0)]  # evicted before its upload
        assert cache.discard(k(1))  # discarded (proven corrupt) before its upload
        assert not cache.discard(k(7))
        gone = locate(cache, k(2))
        assert gone is not None
        os.unlink(gone.path)
        cache.forget(k(2), gone.path)  # its file was lost
        bad = locate(cache, k(3))
        assert bad is not None
        os.unlink(bad.path)
        assert cache.fsck(fix=True).lost_uploads == 1  # repaired away by fsck
        removals = cache.take_removals()
        assert removals.lost_uploads == {"evicted": 1, "discarded": 1, "lost": 1, "fsck": 1}
        assert removals.evicted == 2
        assert cache.take_removals().lost_uploads == {}
        assert cache.backlog().chunks == 2


def test_a_chunk_an_uploader_holds_is_left_for_the_uploader_to_count(cache_dir: Path) -> None:
    with NVMeCache(cache_dir, 10 * U) as cache:
        fill(cache, range(2), pending_upload=True)
        assert [c.key for c in cache.claim_uploads(1, lease_s=60)] == [k(0)]
        assert cache.evict(0) == [k(0), k(1)]
        assert cache.take_removals().lost_uploads == {"evicted": 1}, "k(1) only: k(0)'s upload may succeed"
        # Its upload failed: the uploader learns the chunk is gone, and counts it.
        assert cache.finish_uploads([], [k(0)]) == [k(0)]
        assert cache.backlog().chunks == 0


def test_make_room_evicts_what_a_write_needs(cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstore.cache"), NVMeCache(cache_dir, 10 * U) as cache:
        assert not [r for r in caplog.records if "cache_bytes" in r.getMessage()], (
            "room for the budget: no warning"
        )
        assert cache.effective_budget() == 10 * U
        assert cache.effective_budget(written_bytes=5 * U) == 10 * U, "never above the budget"
        fill(cache, range(10))
        assert cache.make_room(3 * U) == [k(0), k(1), k(2)]
        assert cache.used_bytes() == 7 * U
        assert cache.make_room(3 * U) == [], "there is room already"
        assert cache.make_room(3 * U + 1) == [k(3)]
