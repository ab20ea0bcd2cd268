"""The NVMe cache against a dict model, with random sizes and a small budget.

Eviction is the cache's choice, so the model tracks what *may* be cached (the bytes last admitted per key) and
what *must* be cached (admitted while pinned, or pinned while present); everything else may be a miss. What
left the cache is learnt from the node's change log, as engines learn it. The upload journal must hold exactly
the resident chunks admitted as pending and not uploaded since.
"""

from __future__ import annotations

import collections
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvstore.cache import ChangeKind, NVMeCache, ReadStatus
from kvstore.cache.records import Removals
from kvstore.chunk import HEADER_BLOCK, stored_size
from tests.cache_helpers import admit, cached_keys, locate, read_status

BUDGET = 6 * 4096
KEYS = st.sampled_from([f"ns/{i:02d}.bin" for i in range(6)])


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="nvme-sm-")
        self.cache = NVMeCache(self.dir, BUDGET, index_flush_s=60.0, touch_buffer_max=3)
        self.stored: dict[str, bytes] = {}  # what a hit must return
        self.pins: dict[str, int] = {}
        self.must_have: set[str] = set()
        self.pending: set[str] = set()  # admitted as not yet uploaded
        self.seq = self.cache.change_seq()  # where this model's reading of the change log stands
        self.evictions = 0  # in the change log and not yet in take_removals
        self.lost: collections.Counter[str] = collections.Counter()  # likewise, chunks never uploaded

    def teardown(self) -> None:
        self.cache.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @initialize()
    def start_empty(self) -> None:
        assert self.cache.usage().entries == 0

    def _changes(self) -> list[tuple[ChangeKind, str]]:
        changes = self.cache.changes_since(self.seq, limit=1 << 20)
        assert [c.seq for c in changes] == list(range(self.seq, self.seq + len(changes))), "a gap in the log"
        self.seq += len(changes)
        return [(c.kind, c.key) for c in changes]

    def _forget_evicted(self, *, removed: frozenset[str] = frozenset()) -> list[str]:
        """Apply what the change log says left the cache; returns the keys evicted, in order. Only the keys
        in `removed` (the caller's own discard) may be REMOVED: nothing else here damages chunks."""
        evicted: list[str] = []
        for kind, key in self._changes():
            assert kind is not ChangeKind.UPLOADED, "only the upload rule finishes uploads"
            if kind is ChangeKind.EVICTED:
                assert key not in self.must_have, f"pinned {key} was evicted"
                evicted.append(key)
            else:
                assert key in removed, f"{key} was removed ({kind.name}) unasked"
            if key in self.pending:  # its only copy (no claim outlives its call here: lease_s=0)
                self.lost["evicted" if kind is ChangeKind.EVICTED else "discarded"] += 1
            self.stored.pop(key, None)
            self.pending.discard(key)
        self.evictions += len(evicted)
        return evicted

    @rule(
        key=KEYS,
        size=st.integers(0, 3 * 4096),
        fill=st.binary(min_size=1, max_size=1),
        pending=st.booleans(),
    )
    def put(self, key: str, size: int, fill: bytes, pending: bool) -> None:
        blob = fill * size
        present = self.cache.contains_many([key])[0]
        resident = cached_keys(self.cache)
        pinned_bytes = sum(stored_size(len(self.stored[k])) for k in resident if self.pins.get(k, 0))
        admitted = admit(self.cache, key, blob, pending_upload=pending)
        if present or stored_size(size) > BUDGET:
            assert not admitted
        else:
            # Rejected exactly when the pinned bytes leave no room; anything unpinned can be evicted.
            assert admitted == (pinned_bytes + stored_size(size) <= BUDGET)
        self._forget_evicted()
        if admitted:
            self.stored[key] = blob
            if pending:
                self.pending.add(key)
            if self.pins.get(key, 0):
                self.must_have.add(key)

    @rule(n=st.integers(1, 4), fail=st.booleans())
    def upload(self, n: int, fail: bool) -> None:
        claimed = self.cache.claim_uploads(n, lease_s=0.0)
        assert {c.key for c in claimed} <= self.pending
        keys = [c.key for c in claimed]
        if fail:
            self.cache.finish_uploads([], keys, retry_in_s=0.0)
        else:
            self.cache.finish_uploads(keys)
            self.pending -= set(keys)
        assert self._changes() == [(ChangeKind.UPLOADED, k) for k in ([] if fail else keys)]

    @rule(key=KEYS)
    def load(self, key: str) -> None:
        status, data = read_status(self.cache, key)
        if key in self.must_have:
            assert status is ReadStatus.OK
        assert status in (None, ReadStatus.OK), f"{key}: {status}"
        if status is ReadStatus.OK:
            assert data == self.stored[key]
        else:
            assert key not in self.stored, "a miss the change log did not announce"

    @rule(goal=st.integers(0, BUDGET))
    def evict(self, goal: int) -> None:
        resident = cached_keys(self.cache)
        sizes = {k: stored_size(len(self.stored[k])) for k in resident}
        evicted = self.cache.evict(goal)
        assert self._forget_evicted() == evicted
        assert self.cache.take_removals() == Removals(self.evictions, dict(self.lost))
        self.evictions, self.lost = 0, collections.Counter()
        left = cached_keys(self.cache)
        assert set(left) == set(resident) - set(evicted)
        # Down to the goal unless only pinned chunks are left, and no further than that.
        used = self.cache.usage().used_bytes
        assert used <= goal or all(self.pins.get(k, 0) for k in left)
        if evicted:
            assert used + sizes[evicted[-1]] > goal

    @rule(key=KEYS)
    def locate(self, key: str) -> None:
        loc = locate(self.cache, key)
        if loc is not None:
            with open(loc.path, "rb") as f:
                data = f.read()
            size = len(self.stored[key])
            assert (
                len(data) == stored_size(size)
                and data[HEADER_BLOCK : HEADER_BLOCK + size] == self.stored[key]
            )

    @rule(key=KEYS)
    def discard(self, key: str) -> None:
        self.must_have.discard(key)  # an explicit discard may remove a pinned key
        self.cache.discard(key)
        self._forget_evicted(removed=frozenset([key]))
        self.stored.pop(key, None)
        self.pending.discard(key)

    @rule(key=KEYS)
    def pin(self, key: str) -> None:
        self.cache.pin([key])
        self.pins[key] = self.pins.get(key, 0) + 1
        if self.cache.contains_many([key])[0]:
            self.must_have.add(key)

    @rule(key=KEYS)
    def unpin(self, key: str) -> None:
        self.cache.unpin([key])  # also exercises unpinning a key without pins (a no-op)
        self.pins[key] = max(0, self.pins.get(key, 0) - 1)
        if not self.pins[key]:
            self.must_have.discard(key)

    @rule(keys=st.lists(KEYS, max_size=4))
    def touch(self, keys: list[str]) -> None:
        self.cache.touch(keys)

    @rule()
    def flush(self) -> None:
        self.cache.flush()

    @invariant()
    def usage_is_consistent(self) -> None:
        usage = self.cache.usage()
        assert usage.used_bytes <= BUDGET
        keys = cached_keys(self.cache)
        assert usage.entries == len(keys)
        assert usage.used_bytes == sum(stored_size(len(self.stored[k])) for k in keys)
        assert set(keys) == set(self.stored), "every departure is in the change log"
        assert self.must_have <= set(keys)
        assert usage.pinned_entries == sum(1 for k in keys if self.pins.get(k, 0))
        for key, count in self.pins.items():
            assert self.cache.pinned(key) == count
        backlog = self.cache.backlog()
        queued = self.pending & set(keys)
        assert backlog.chunks == len(queued)
        assert backlog.bytes == sum(stored_size(len(self.stored[k])) for k in queued)


TestCacheMachine = pytest.mark.slow(CacheMachine.TestCase)
TestCacheMachine.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_final_fsck_after_random_run() -> None:
    # Complements the machine: a long sequence, then a full fsck.
    import random

    directory = tempfile.mkdtemp(prefix="nvme-sm-")
    try:
        rng = random.Random(7)
        with NVMeCache(directory, BUDGET, index_flush_s=60.0) as cache:
            for _ in range(400):
                key = f"ns/{rng.randrange(20)}"
                if rng.random() < 0.1:
                    cache.pin([key])
                elif rng.random() < 0.1:
                    cache.unpin([key])
                admit(
                    cache, key, bytes([len(key)]) * rng.randrange(3 * 4096), pending_upload=rng.random() < 0.5
                )
                if rng.random() < 0.05:
                    cache.evict(rng.randrange(BUDGET))
            assert cache.usage().used_bytes <= BUDGET
            assert cache.fsck().clean
    finally:
        shutil.rmtree(directory, ignore_errors=True)
