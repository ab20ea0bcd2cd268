"""Compute vLLM's prefix-caching block hashes and our chunk keys for a token sequence, without vLLM.

This is what lets the fleet tools (pins, warming) name the chunks a prompt will produce before any engine has
seen it. The scheme mirrors vLLM 0.32 (`vllm.v1.core.kv_cache_utils` and the offloading connector):

- tokens are hashed in full blocks of `tokens_per_hash` tokens; a trailing partial block has no hash;
- block i's hash is `H((parent, tuple(block_tokens), extra_keys))`, parent being block i-1's hash, or for the
  first block the seed hash `H(seed)`; `extra_keys` is `None` for plain text (no LoRA, multimodal input,
  cache salt or prompt embeddings, which we do not model);
- `H` is the engine's `--prefix-caching-hash-algo`, default `sha256` = SHA-256 over
  `pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)`; `sha256_cbor` = SHA-256 over canonical CBOR;
- the seed is `$PYTHONHASHSEED` when set, else the fixed string `"vllm-none-hash"` (for the sha256 family;
  the xxhash family uses a random per-process seed unless PYTHONHASHSEED is set, so it is unsupported here);
- the offloading connector stores chunks of `tokens_per_block * blocks_per_chunk` tokens per KV-cache group;
  chunk j's key is `OffloadKey(hash of the last block inside chunk j, group index)`.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError
from kvstore.keys import Namespace, make_offload_key

__all__ = [
    "DEFAULT_HASH_ALGO",
    "DEFAULT_SEED",
    "SUPPORTED_HASH_ALGOS",
    "ChunkRef",
    "block_hashes",
    "chunk_keys",
    "chunk_refs",
    "hash_function",
    "none_hash",
    "resolve_seed",
]

DEFAULT_HASH_ALGO = "sha256"
# vLLM's fixed seed for cryptographic algorithms when PYTHONHASHSEED is unset (shareable across processes).
DEFAULT_SEED = "vllm-none-hash"

HashFn = Callable[[Any], bytes]


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2  # a vLLM dependency; imported lazily because the default algorithm does not need it

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


_ALGOS: dict[str, HashFn] = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}
# What this module computes exactly as vLLM does; the xxhash family is the engine's alone.
SUPPORTED_HASH_ALGOS = frozenset(_ALGOS)


def hash_function(algo: str = DEFAULT_HASH_ALGO) -> HashFn:
    """The hash function vLLM uses for `--prefix-caching-hash-algo=<algo>`.

    The xxhash algorithms are refused: without PYTHONHASHSEED vLLM seeds them randomly per process, so no
    outside tool can predict their keys (and such keys cannot be shared between instances either)."""
    try:
        return _ALGOS[algo]
    except KeyError:
        raise ConfigError(
            f"prefix_caching_hash_algo {algo!r} is not supported; use one of {sorted(_ALGOS)}"
        ) from None


def resolve_seed(seed: str | None = None) -> str:
    """The NONE_HASH seed: an explicit value, else $PYTHONHASHSEED, else vLLM's fixed default."""
    if seed is not None:
        return seed
    env = os.environ.get("PYTHONHASHSEED")
    return env if env is not None else DEFAULT_SEED


def none_hash(algo: str = DEFAULT_HASH_ALGO, seed: str | None = None) -> bytes:
    """The parent hash of a sequence's first block."""
    return hash_function(algo)(resolve_seed(seed))


def block_hashes(
    token_ids: Sequence[int],
    tokens_per_hash: int,
    *,
    algo: str = DEFAULT_HASH_ALGO,
    seed: str | None = None,
) -> list[bytes]:
    """The chained hash of every full `tokens_per_hash`-token block of `token_ids`, in order."""
    if tokens_per_hash <= 0:
        raise ConfigError(f"tokens_per_hash must be positive, got {tokens_per_hash}")
    fn = hash_function(algo)
    parent = fn(resolve_seed(seed))
    # Plain ints only: pickle would encode numpy ints or bools differently from the engine's Python ints.
    tokens = [int(t) for t in token_ids]
    out: list[bytes] = []
    for start in range(0, len(tokens) - tokens_per_hash + 1, tokens_per_hash):
        parent = fn((parent, tuple(tokens[start : start + tokens_per_hash]), None))
        out.append(parent)
    return out


@dataclass(frozen=True)
class ChunkRef:
    """One chunk a token sequence maps to: its group, its index within the group, and its names."""

    group: int
    index: int
    end_token: int  # tokens [0, end_token) are covered once this chunk is loaded
    offload_key: bytes
    key: str  # the object key (relative to the store prefix), `Namespace.chunk_key(offload_key)`


def _group_block_sizes(namespace: Namespace) -> list[int]:
    # A namespace recorded without groups (older configs, hand-built ones) has one group at hash granularity.
    sizes = [g.tokens_per_block for g in namespace.kv_cache_groups] or [namespace.tokens_per_hash]
    for size in sizes:
        if size % namespace.tokens_per_hash:
            raise ConfigError(
                f"group tokens_per_block {size} is not a multiple of "
                f"tokens_per_hash {namespace.tokens_per_hash}"
            )
    return sizes


def chunk_refs(
    namespace: Namespace,
    token_ids: Sequence[int],
    *,
    blocks_per_chunk: int = 1,
    algo: str = DEFAULT_HASH_ALGO,
    seed: str | None = None,
) -> list[ChunkRef]:
    """Every full chunk `token_ids` produces in `namespace`, group by group, in token order."""
    if blocks_per_chunk <= 0:
        raise ConfigError(f"blocks_per_chunk must be positive, got {blocks_per_chunk}")
    hashes = block_hashes(token_ids, namespace.tokens_per_hash, algo=algo, seed=seed)
    refs: list[ChunkRef] = []
    for group, block_size in enumerate(_group_block_sizes(namespace)):
        tokens_per_chunk = block_size * blocks_per_chunk
        per_chunk = tokens_per_chunk // namespace.tokens_per_hash
        # The connector names a chunk by the hash that ends it: that hash fingerprints the whole prefix.
        for index, pos in enumerate(range(per_chunk - 1, len(hashes), per_chunk)):
            offload_key = make_offload_key(hashes[pos], group)
            refs.append(
                ChunkRef(
                    group,
                    index,
                    (index + 1) * tokens_per_chunk,
                    offload_key,
                    namespace.chunk_key(offload_key),
                )
            )
    return refs


def chunk_keys(
    namespace: Namespace,
    token_ids: Sequence[int],
    *,
    blocks_per_chunk: int = 1,
    algo: str = DEFAULT_HASH_ALGO,
    seed: str | None = None,
) -> list[str]:
    """The object keys of `chunk_refs`, in the same order."""
    refs = chunk_refs(namespace, token_ids, blocks_per_chunk=blocks_per_chunk, algo=algo, seed=seed)
    return [r.key for r in refs]
