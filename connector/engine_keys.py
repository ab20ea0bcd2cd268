"""The key scheme of the vLLM engine this process runs: its `NONE_HASH`, read from vLLM, as a `KeyScheme`,
and its record beside the namespace in the bucket.

The engine core derives `NONE_HASH` from the seed just after it builds the scheduler (and so our tier), so
the tier reads it once it is set (`wait_for_engine_scheme`, on a thread of its own). The tier never sees the
hash algorithm's name; it is recognised by recomputing `NONE_HASH` with each algorithm `kvstore.hashing`
knows. No match means the xxhash family (or a future algorithm): keys that only vLLM
computes, random per process unless PYTHONHASHSEED is set.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from kvstore.errors import StoreError
from kvstore.hashing import DEFAULT_HASH_ALGO, SUPPORTED_HASH_ALGOS, none_hash, resolve_seed
from kvstore.key_scheme import KeyScheme, namespace_schemes, record_scheme, scheme_for, seed_fingerprint
from kvstore.keys import Namespace
from kvstore.stores import ObjectStore

__all__ = ["engine_scheme", "publish_namespace", "wait_for_engine_scheme"]

log = logging.getLogger(__name__)

# NONE_HASH is looked for at once, then after 20 ms, 40 ms... at most a second apart: an engine sets it
# within the first waits, and a tier built outside one (tools, tests, benchmarks), which never sees it, would
# otherwise wake 50 times a second for two minutes beside the loads it serves.
_POLL_S = 0.02
_POLL_MAX_S = 1.0
# vLLM sets NONE_HASH just after building the scheduler (and the tier); a tier built elsewhere never sees it.
_NONE_HASH_WAIT_S = 120.0


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
    deadline = time.monotonic() + timeout_s
    wait = _POLL_S
    while True:
        scheme, from_engine = engine_scheme()
        left = deadline - time.monotonic()
        if from_engine or left <= 0 or stop.wait(min(wait, left)):
            return scheme, from_engine
        wait = min(2 * wait, _POLL_MAX_S)


def publish_namespace(store: ObjectStore, namespace: Namespace, stop: threading.Event) -> KeyScheme | None:
    """Describe `namespace` in the bucket once, like vLLM's fs tier writes its config.json; once vLLM has
    set NONE_HASH, record this engine's key scheme beside it and warn when its keys can never be shared: a
    random per-process seed, or engines with other seeds already writing the namespace. The engine's
    scheme, or None outside an engine (a tier built by tools or tests has no scheme of its own to record).
    """
    try:
        body = json.dumps(namespace.fields(), indent=2, sort_keys=True).encode()
        store.put_if_absent(namespace.config_key, body)
    except StoreError as exc:
        log.warning("could not write %s: %s", namespace.config_key, exc)
    scheme, from_engine = wait_for_engine_scheme(_NONE_HASH_WAIT_S, stop)
    if not from_engine:
        return None
    if not scheme.shareable:
        log.warning(
            "KVStoreTier: this engine's block hashes use a random per-process seed (xxhash without "
            "PYTHONHASHSEED): no other instance, restart, pin or warm run will ever compute its keys, so "
            "nothing it stores can be shared. Use --prefix-caching-hash-algo sha256, or set the same "
            "PYTHONHASHSEED on every instance."
        )
    try:
        record_scheme(store, namespace, scheme)
        others = [
            s for s in namespace_schemes(store, namespace) if s.seed_fingerprint != scheme.seed_fingerprint
        ]
    except StoreError as exc:
        log.warning("could not describe namespace %s in the bucket: %s", namespace.id, exc)
        return scheme
    if others:
        log.warning(
            "KVStoreTier: %d other key scheme(s) already write namespace %s (%s); this engine's keys "
            "(%s) never match theirs, so neither side reuses the other's chunks. Give every engine the "
            "same --prefix-caching-hash-algo and PYTHONHASHSEED.",
            len(others),
            namespace.id,
            ", ".join(_describe(s) for s in others),
            _describe(scheme),
        )
    return scheme


def _describe(scheme: KeyScheme) -> str:
    return f"{scheme.hash_algo or 'xxhash family'}/{scheme.seed_fingerprint}"
