"""Helpers for the cache tests that also run in child processes (multiprocessing 'spawn', or as a script).

Content is derived deterministically from the key, so any process can tell whether bytes are right.

As a script: ``python cache_workers.py DIR SEED BUDGET`` admits, reads and discards chunks in a loop until
killed; it prints ``ready`` once the cache is open.
"""

from __future__ import annotations

import hashlib
import random
import sys

from kvstore.cache import NVMeCache


def key_for(i: int) -> str:
    digest = hashlib.sha256(str(i).encode()).hexdigest()
    return f"llama_abc123def456_r0/{digest[:3]}/{digest[3:5]}_g0/{digest}.bin"


def blob_for(key: str) -> bytes:
    """Raw chunk bytes whose content and length (64..8255: one to three 4 KiB blocks) depend only on the
    key."""
    seed = hashlib.blake2b(key.encode(), digest_size=32).digest()
    length = 64 + int.from_bytes(seed[:2], "little") % 8192
    return (seed * (length // len(seed) + 1))[:length]


def mixed_workload(directory: str, seed: int, rounds: int, budget: int, n_keys: int) -> int:
    """Put/get/discard random overlapping keys; returns the number of wrong reads (must be 0)."""
    rng = random.Random(seed)
    wrong = 0
    with NVMeCache(directory, budget) as cache:
        for _ in range(rounds):
            key = key_for(rng.randrange(n_keys))
            op = rng.random()
            if op < 0.5:
                cache.put(key, blob_for(key))
            elif op < 0.9:
                data = cache.get(key)
                if data is not None and data != blob_for(key):
                    wrong += 1
            elif op < 0.95:
                cache.discard(key)
            else:
                cache.touch([key_for(rng.randrange(n_keys)) for _ in range(8)])
    return wrong


def _crash_loop(directory: str, seed: int, budget: int) -> None:
    rng = random.Random(seed)
    cache = NVMeCache(directory, budget)
    print("ready", flush=True)
    while True:  # until SIGKILL
        key = key_for(rng.randrange(300))
        if rng.random() < 0.8:
            cache.put(key, blob_for(key))
        elif rng.random() < 0.5:
            cache.get(key)
        else:
            cache.discard(key)


if __name__ == "__main__":
    _crash_loop(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
