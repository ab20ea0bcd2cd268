"""Which block hashes a namespace's engines compute: the hash algorithm and a fingerprint of their seed.

vLLM chains every block hash from `NONE_HASH = H(seed)`, the seed being `$PYTHONHASHSEED` or, for the sha256
family, a fixed default; the xxhash family draws a random seed per process unless PYTHONHASHSEED is set. Two
engines whose seeds differ compute different keys for the same tokens, so they silently fill one namespace
with chunks nobody shares, and a pin or a warm run from a shell with another seed names chunks that never
exist. The namespace folder therefore records what its engines compute, one small object per scheme::

    <namespace id>/engines/<seed fingerprint>.json   {"hash_algo": "sha256" | null, "seed_fingerprint",
                                                      "random_seed": bool, "recorded_at": <unix s>}

The fingerprint is a digest of `NONE_HASH`, never the seed or `NONE_HASH` itself: for xxhash the seed must
stay secret (vLLM keeps it random so nobody can precompute colliding blocks). `hash_algo` is null when the
engine's algorithm is not one `kvstore.hashing` can compute (the xxhash family). The tier writes its record at
start-up (`record_scheme`); tools that compute keys outside an engine check theirs against the records first
(`check_scheme`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass

from kvstore.errors import ConfigError, StoreError
from kvstore.hashing import DEFAULT_HASH_ALGO, SUPPORTED_HASH_ALGOS, none_hash
from kvstore.keys import Namespace
from kvstore.stores.base import ObjectStore

__all__ = [
    "ENGINES_DIR",
    "KeyScheme",
    "SeedMismatch",
    "check_scheme",
    "namespace_schemes",
    "record_scheme",
    "scheme_for",
    "seed_fingerprint",
]

log = logging.getLogger(__name__)

ENGINES_DIR = "engines"
_FINGERPRINT_DOMAIN = b"kvstore/none-hash/v1"


class SeedMismatch(ConfigError):
    """The keys computed here can never match the ones the namespace's engines compute."""


def seed_fingerprint(none_hash_value: bytes) -> str:
    """16 hex digits naming a `NONE_HASH` without revealing it."""
    return hashlib.sha256(_FINGERPRINT_DOMAIN + bytes(none_hash_value)).hexdigest()[:16]


@dataclass(frozen=True)
class KeyScheme:
    """How an engine (or a tool) names chunks: its algorithm, if computable here, and its seed fingerprint."""

    hash_algo: str | None
    seed_fingerprint: str
    random_seed: bool = False  # xxhash without PYTHONHASHSEED: no other process computes the same keys

    @property
    def shareable(self) -> bool:
        return not self.random_seed

    def to_json(self) -> dict[str, object]:
        return {
            "hash_algo": self.hash_algo,
            "seed_fingerprint": self.seed_fingerprint,
            "random_seed": self.random_seed,
        }

    @classmethod
    def from_json(cls, raw: bytes) -> KeyScheme:
        try:
            doc = json.loads(raw)
            algo = doc.get("hash_algo")
            return cls(
                hash_algo=None if algo is None else str(algo),
                seed_fingerprint=str(doc["seed_fingerprint"]),
                random_seed=bool(doc.get("random_seed", False)),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"malformed key scheme record: {exc}") from None


def scheme_for(algo: str = DEFAULT_HASH_ALGO, seed: str | None = None) -> KeyScheme:
    """The scheme `kvstore.hashing` uses in this process for `algo` (seed: explicit, $PYTHONHASHSEED, or
    vLLM's default)."""
    return KeyScheme(algo, seed_fingerprint(none_hash(algo, seed)))


def _record_key(namespace: Namespace, fingerprint: str) -> str:
    return f"{namespace.id}/{ENGINES_DIR}/{fingerprint}.json"


def record_scheme(store: ObjectStore, namespace: Namespace, scheme: KeyScheme) -> None:
    """Add `scheme` to the namespace's records (create-only: the first writer's record stands)."""
    body = dict(scheme.to_json(), recorded_at=round(time.time(), 3))
    store.put_if_absent(_record_key(namespace, scheme.seed_fingerprint), json.dumps(body).encode())


def namespace_schemes(store: ObjectStore, namespace: Namespace) -> list[KeyScheme]:
    """Every scheme recorded for the namespace, in listing order; unreadable records are skipped (logged)."""
    out: list[KeyScheme] = []
    for info in store.list(f"{namespace.id}/{ENGINES_DIR}/"):
        if not info.key.endswith(".json"):
            continue
        raw = store.get(info.key)
        if raw is None:
            continue
        try:
            out.append(KeyScheme.from_json(raw))
        except ConfigError as exc:
            log.warning("skipping %s: %s", info.key, exc)
    return out


def check_scheme(
    store: ObjectStore, namespace: Namespace, *, seed: str | None = None
) -> tuple[KeyScheme, str | None]:
    """The scheme a tool should hash with for `namespace`, and a warning when it cannot be sure.

    Against the namespace's records: the first shareable engine whose algorithm `kvstore.hashing` computes
    and whose fingerprint this process reproduces wins. No record (a namespace from before these records, or
    a store that cannot be read): vLLM's default, with a warning. Records that all differ: `SeedMismatch`,
    which names what to change, because every key computed here would name a chunk no engine writes."""
    try:
        recorded = namespace_schemes(store, namespace)
    except StoreError as exc:
        return scheme_for(), f"could not read the namespace's key schemes ({exc}); assuming vLLM's defaults"
    if not recorded:
        return scheme_for(), (
            f"namespace {namespace.id} records no key scheme (its engines predate it); assuming "
            f"{DEFAULT_HASH_ALGO} with {'PYTHONHASHSEED' if seed is None else 'the given seed'} as here"
        )
    for engine in recorded:
        if engine.hash_algo in SUPPORTED_HASH_ALGOS and engine.shareable:
            mine = scheme_for(engine.hash_algo, seed)
            if mine.seed_fingerprint == engine.seed_fingerprint:
                return mine, None
    described = ", ".join(
        f"{e.hash_algo or 'xxhash family'}/{e.seed_fingerprint}{' (random seed)' if e.random_seed else ''}"
        for e in recorded
    )
    computable = [e for e in recorded if e.hash_algo in SUPPORTED_HASH_ALGOS and e.shareable]
    if not computable:
        raise SeedMismatch(
            f"the engines of namespace {namespace.id} hash with {described}: keys no tool outside them can "
            "compute (run them with --prefix-caching-hash-algo sha256 and a shared PYTHONHASHSEED)"
        )
    here = scheme_for(computable[0].hash_algo or DEFAULT_HASH_ALGO, seed)
    if seed is not None:
        source = "the given seed"
    else:
        source = "PYTHONHASHSEED " + ("set" if os.environ.get("PYTHONHASHSEED") is not None else "unset")
    raise SeedMismatch(
        f"this process's seed ({source}, fingerprint {here.seed_fingerprint}) differs from the engines of "
        f"namespace {namespace.id} ({described}): set PYTHONHASHSEED as they do"
    )
