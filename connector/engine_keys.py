"""The key scheme of the vLLM engine this process runs: its `NONE_HASH`, read from vLLM, as a `KeyScheme`.

The engine core derives `NONE_HASH` from the seed just after it builds the scheduler (and so our tier), so
the tier reads it once it is set (`wait_for_engine_scheme`, on a thread of its own). The tier never sees the
hash algorithm's name; it is recognised by recomputing `NONE_HASH` with each algorithm `kvstore.hashing`
knows. No match means the xxhash family (or a future algorithm): keys that only vLLM
computes, random per process unless PYTHONHASHSEED is set.
"""

from __future__ import annotations

import os
import threading

from kvstore.hashing import DEFAULT_HASH_ALGO, SUPPORTED_HASH_ALGOS, none_hash, resolve_seed
from kvstore.key_scheme import KeyScheme, scheme_for, seed_fingerprint

__all__ = ["engine_scheme", "wait_for_engine_scheme"]

_POLL_S = 0.02


def engine_scheme() -> tuple[KeyScheme, bool]:
    """(the running engine's key scheme, whether it was read from vLLM). Outside an engine (a tier built
    by tools or tests) `NONE_HASH` is unset: vLLM's defaults for this environment are assumed."""
    from vllm.v1.core import kv_cache_utils

    value = getattr(kv_cache_utils, "NONE_HASH", None)
    if value is None:
        return scheme_for(DEFAULT_HASH_ALGO), False
    get_seed = getattr(kv_cache_utils, "get_none_hash_seed", None)  # vLLM >= 0.32
    seed = get_seed() if get_seed is not None else resolve_seed()
    actual = bytes(value)
    for algo in sorted(SUPPORTED_HASH_ALGOS):
        try:
            if none_hash(algo, seed) == actual:
                return KeyScheme(algo, seed_fingerprint(actual)), True
        except ImportError:  # sha256_cbor needs cbor2, which a trimmed install may lack
            continue
    # Not an algorithm we compute: its seed is random per process unless PYTHONHASHSEED fixed it.
    return KeyScheme(None, seed_fingerprint(actual), random_seed="PYTHONHASHSEED" not in os.environ), True


def wait_for_engine_scheme(timeout_s: float, stop: threading.Event) -> tuple[KeyScheme, bool]:
    """`engine_scheme()` once vLLM has set `NONE_HASH` (at most `timeout_s`, or until `stop` is set)."""
    deadline = timeout_s
    while True:
        scheme, from_engine = engine_scheme()
        if from_engine or deadline <= 0 or stop.wait(_POLL_S):
            return scheme, from_engine
        deadline -= _POLL_S
