"""Helpers for the cache tests that also run in child processes (multiprocessing 'spawn', or as a script).

Content is derived deterministically from the key, so any process can tell whether bytes are right. The
children drive the cache as the product does: ``write_file`` + ``commit`` to admit, ``read_into`` to load,
``forget`` when a file is gone (through ``tests.cache_helpers``).

As a script: ``python cache_workers.py DIR SEED BUDGET`` admits, reads, discards and evicts chunks in a loop
until killed; it prints ``ready`` once the cache is open. ``python cache_workers.py evict-and-die DIR N``
admits N chunks, evicts them all and is killed right after the eviction's commit, before it deletes a file.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import sys
from pathlib import Path

# A child started as a script imports tests.cache_helpers from the repository root, wherever it runs.
_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from kvstore.cache import ChangeKind, NVMeCache, ReadStatus  # noqa: E402
from tests.cache_helpers import admit, locate  # noqa: E402


def key_for(i: int) -> str:
    digest = hashlib.sha256(str(i).encode()).hexdigest()
    return f"llama_abc123def456_r0/{digest[:3]}/{digest[3:5]}_g0/{digest}.bin"


def blob_for(key: str) -> bytes:
    """Raw chunk bytes whose content and length (64..8255: one to three 4 KiB blocks) depend only on the
    key."""
    seed = hashlib.blake2b(key.encode(), digest_size=32).digest()
    length = 64 + int.from_bytes(seed[:2], "little") % 8192
    return (seed * (length // len(seed) + 1))[:length]


def load(cache: NVMeCache, key: str) -> tuple[ReadStatus | None, bytes | None]:
    """The data path's load of `key`: a file another process evicted meanwhile is forgotten by the path that
    was read (a newer admission of the key survives), as the engine does; anything else is left alone."""
    located = locate(cache, key)
    if located is None:
        return None, None
    out = bytearray(located.raw_length)
    status = cache.read_into(located, memoryview(out)).status
    if status is ReadStatus.GONE:
        cache.forget(key, located.path)
    return status, bytes(out) if status is ReadStatus.OK else None


def mixed_workload(directory: str, seed: int, rounds: int, budget: int, n_keys: int) -> int:
    """Admit/load/discard/evict random overlapping keys; returns the number of wrong reads (must be 0): bytes
    that differ from the key's, or a copy that fails its check (files are never rewritten in place, so a
    race with another process may only make a chunk vanish)."""
    rng = random.Random(seed)
    wrong = 0
    with NVMeCache(directory, budget) as cache:
        for _ in range(rounds):
            key = key_for(rng.randrange(n_keys))
            op = rng.random()
            if op < 0.5:
                admit(cache, key, blob_for(key))
            elif op < 0.88:
                status, data = load(cache, key)
                if status not in (None, ReadStatus.OK, ReadStatus.GONE) or (
                    data is not None and data != blob_for(key)
                ):
                    wrong += 1
            elif op < 0.93:
                cache.discard(key)
            elif op < 0.95:
                cache.evict(budget // 2)
            else:
                cache.touch([key_for(rng.randrange(n_keys)) for _ in range(8)])
    return wrong


def make_changes(directory: str, unit: int) -> tuple[int, list[tuple[str, str]]]:
    """In a process of its own, on a cache of four `unit`s (what a 100-byte chunk takes): evict by
    admission, ``evict``, discard and finish an upload; returns the change log's position before it started
    and the (kind, key) changes it made, as this process knows them from the cache's answers."""
    expected: list[tuple[str, str]] = []
    with NVMeCache(directory, 4 * unit) as cache:
        start = cache.change_seq()
        keys = [key_for(i) for i in range(1000, 1008)]
        for key in keys[:4]:
            assert admit(cache, key, b"x" * 100)
        assert admit(cache, keys[4], b"x" * 100, pending_upload=True)  # evicts keys[0]
        expected.append((ChangeKind.EVICTED.name, keys[0]))
        evicted = cache.evict(2 * unit)
        assert evicted == keys[1:3], "the uploaded ones, oldest first"
        expected += [(ChangeKind.EVICTED.name, k) for k in evicted]
        assert cache.discard(keys[4])
        expected.append((ChangeKind.REMOVED.name, keys[4]))
        assert admit(cache, keys[5], b"x" * 100, pending_upload=True)
        assert [c.key for c in cache.claim_uploads(10)] == [keys[5]]
        cache.finish_uploads([keys[5]])
        expected.append((ChangeKind.UPLOADED.name, keys[5]))
    return start, expected


def read_changes(directory: str, seq: int) -> list[tuple[str, str]]:
    """(kind, key) of the node's changes from `seq` on, as another process reads them."""
    with NVMeCache(directory, 1 << 20) as cache:
        return [(c.kind.name, c.key) for c in cache.changes_since(seq, limit=1 << 20)]


def _crash_loop(directory: str, seed: int, budget: int) -> None:
    rng = random.Random(seed)
    cache = NVMeCache(directory, budget)
    print("ready", flush=True)
    while True:  # until SIGKILL
        key = key_for(rng.randrange(300))
        op = rng.random()
        if op < 0.75:
            admit(cache, key, blob_for(key), pending_upload=rng.random() < 0.3)
        elif op < 0.85:
            load(cache, key)
        elif op < 0.95:
            cache.discard(key)
        else:
            cache.evict(rng.randrange(budget))


def _evict_and_die(directory: str, n: int) -> None:
    cache = NVMeCache(directory, 1 << 30)
    for i in range(n):
        admit(cache, key_for(i), blob_for(key_for(i)))

    def killed(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)  # a kill -9 that lands between the commit and the deletions

    os.unlink = killed  # type: ignore[assignment]
    cache.evict(0)


if __name__ == "__main__":
    if sys.argv[1] == "evict-and-die":
        _evict_and_die(sys.argv[2], int(sys.argv[3]))
    else:
        _crash_loop(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
