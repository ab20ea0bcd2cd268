"""Warm the cache for a prompt before traffic arrives: make its chunks exist in the bucket and on this node.

`warm(node, namespace, token_ids, ...)` names the prompt's chunks exactly as the namespace's engines will
(`kvstore.hashing.chunk_keys` with the hash algorithm and seed they record, `kvstore.key_scheme`; a seed
that matches none of them is refused), then for each chunk:

- already on this node (NVMe or the upload queue): nothing to do;
- in the bucket only: with `prefetch`, GET it, verify it and write it to this node's NVMe now (`prefetch`,
  `kvstore.warm_fetch`);
- nowhere: with a vLLM endpoint (`kvstore.vllm_api`), one completion request (`max_tokens=1`) makes an engine
  running our tier
  compute the prompt's KV and store it; the tier uploads write-behind, so the bucket is polled until the
  chunks appear or `poll_s` runs out. Those chunks are not prefetched again here: the engine that produced
  them wrote them to its own NVMe cache (the same cache when it runs on this node).

With `pin`, a pin manifest naming every chunk key is written afterwards (GC keeps them; nodes hold them).
`WarmReport` counts each outcome; an unreachable or failing vLLM raises `VLLMUnreachable` / `VLLMError`,
both naming the URL. This module never imports vLLM or torch: it speaks HTTP (httpx).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from kvstore.engine import Presence
from kvstore.errors import ConfigError, KVStoreError, StoreError
from kvstore.hashing import DEFAULT_HASH_ALGO, chunk_keys
from kvstore.key_scheme import check_scheme
from kvstore.keys import Namespace
from kvstore.pins import PinExists, create_pin, load_namespace
from kvstore.runtime import Node
from kvstore.vllm_api import ServedModel, VLLMError, VLLMUnreachable, find_served, request_prefill
from kvstore.warm_fetch import fetch_into_cache

__all__ = [
    "ServedModel",
    "VLLMError",
    "VLLMUnreachable",
    "WarmError",
    "WarmReport",
    "prefetch",
    "request_prefill",
    "warm",
]

log = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.25


class WarmError(KVStoreError):
    """Warming could not do what was asked."""


@dataclass(frozen=True)
class WarmReport:
    """What one `warm` call found and did. `already_local + remote + produced + still_missing == total`."""

    namespace: str
    num_tokens: int
    total: int  # chunk keys of the prompt (full chunks only, every KV-cache group)
    already_local: int  # on this node before the call
    remote: int  # in the bucket (not on this node) before the call
    prefetched: int  # of `remote`, written to this node's NVMe by this call
    produced: int  # missing before, in the bucket after the vLLM request
    still_missing: int  # in neither place at the end
    pin: str | None  # the pin manifest written, if any
    errors: tuple[str, ...]  # non-fatal problems (a chunk that failed to prefetch, a pin name taken, ...)
    seconds: float
    hash_algo: str = DEFAULT_HASH_ALGO  # what the keys were computed with (the namespace's engines')
    seed_fingerprint: str = ""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["errors"] = list(self.errors)
        return out


def prefetch(node: Node, keys: Sequence[str], *, cancel: threading.Event | None = None) -> int:
    """Bring `keys` from the object store into the node's NVMe cache now; how many are cached after.

    Chunks are verified and admitted exactly as an engine admits the object hits it served. With `cancel`
    set, it stops before the next batch."""
    if not keys:
        return 0
    engine = node.engine
    fetch_into_cache(node.cache, node.store, engine.threads, keys, engine.metrics, cancel=cancel)
    return sum(node.cache.contains_many(keys))


def _exists(node: Node, keys: list[str]) -> list[bool]:
    """Which `keys` the bucket holds now; a failing store answers "none" (logged)."""
    try:
        return node.store.exists_many(keys)
    except StoreError as exc:
        log.warning("could not ask the object store about %d chunks: %s", len(keys), exc)
        return [False] * len(keys)


def _wait_for(node: Node, keys: list[str], poll_s: float, cancel: threading.Event | None) -> list[bool]:
    """Poll the bucket until every key exists, `poll_s` passes or `cancel` is set; which keys exist."""
    deadline = time.monotonic() + poll_s
    present = [False] * len(keys)
    while True:
        todo = [i for i, ok in enumerate(present) if not ok]
        found = _exists(node, [keys[i] for i in todo])
        for i, ok in zip(todo, found, strict=True):
            present[i] = ok
        if all(present) or time.monotonic() >= deadline or (cancel is not None and cancel.is_set()):
            return present
        if cancel is not None:
            cancel.wait(_POLL_INTERVAL_S)
        else:
            time.sleep(_POLL_INTERVAL_S)


def warm(
    node: Node,
    namespace: Namespace | str,
    token_ids: Sequence[int],
    *,
    vllm: ServedModel | None = None,
    vllm_url: str | None = None,
    vllm_urls: Sequence[str] = (),
    model: str | None = None,
    prefetch: bool = True,
    pin: str | None = None,
    pin_ttl_s: float | None = None,
    blocks_per_chunk: int = 1,
    timeout_s: float = 120.0,
    poll_s: float = 15.0,
    client: httpx.Client | None = None,
    cancel: threading.Event | None = None,
) -> WarmReport:
    """Make the chunks of `token_ids` present (see the module docstring). `namespace` is a `Namespace` or
    the id of one published in the bucket. Missing chunks are produced by `vllm` (a served model already
    found), or by the model `model` (default: the first) at `vllm_url`, or at the first of `vllm_urls` that
    serves it. `timeout_s` bounds the vLLM request, `poll_s` the wait for its uploads; `cancel`, once set,
    stops the prefetch before its next batch and the wait at its next poll. Keys are hashed like the
    namespace's engines (`kvstore.key_scheme`). Raises `NamespaceNotFound`, `ConfigError` (no full chunk,
    bad URL), `SeedMismatch` (no engine of the namespace computes these keys), `VLLMUnreachable`,
    `VLLMError`."""
    started = time.monotonic()
    ns = load_namespace(node.store, namespace) if isinstance(namespace, str) else namespace
    scheme, warning = check_scheme(node.store, ns)
    algo = scheme.hash_algo or DEFAULT_HASH_ALGO
    keys = list(dict.fromkeys(chunk_keys(ns, token_ids, blocks_per_chunk=blocks_per_chunk, algo=algo)))
    if not keys:
        raise ConfigError(
            f"{len(token_ids)} tokens make no full chunk "
            f"(tokens_per_hash={ns.tokens_per_hash}); nothing to warm"
        )
    errors: list[str] = [] if warning is None else [warning]
    where = node.engine.lookup(keys, wait=True)
    local = [k for k, p in zip(keys, where, strict=True) if p is Presence.LOCAL]
    remote = [k for k, p in zip(keys, where, strict=True) if p is Presence.REMOTE]
    missing = [k for k, p in zip(keys, where, strict=True) if p not in (Presence.LOCAL, Presence.REMOTE)]
    if missing:
        # The engine remembers misses for `probe_miss_ttl_s`; ask the bucket itself before recomputing.
        fresh = _exists(node, missing)
        remote += [k for k, ok in zip(missing, fresh, strict=True) if ok]
        missing = [k for k, ok in zip(missing, fresh, strict=True) if not ok]

    prefetched = 0
    if prefetch and remote:
        prefetched = _prefetch_checked(node, remote, missing, errors, cancel)

    produced = 0
    urls = [vllm_url] if vllm_url is not None else list(vllm_urls)
    if missing and (vllm is not None or urls):
        own = client is None
        http = client or httpx.Client(timeout=timeout_s)
        try:
            served = vllm or find_served(http, urls, model, timeout_s=timeout_s)
            request_prefill(http, served, token_ids, timeout_s=timeout_s)
        finally:
            if own:
                http.close()
        log.info("asked vLLM at %s (%s) to prefill %d tokens", served.base_url, served.name, len(token_ids))
        present = _wait_for(node, missing, poll_s, cancel)
        produced = sum(present)
        missing = [k for k, ok in zip(missing, present, strict=True) if not ok]
        if missing:
            errors.append(
                f"{len(missing)} chunks did not appear in the bucket within {poll_s:g}s of the vLLM request "
                "(is the server running the KVStore tier on this bucket and namespace?)"
            )

    pinned: str | None = None
    if pin is not None:
        try:
            create_pin(node.store, pin, ns, keys, ttl_seconds=pin_ttl_s)
            pinned = pin
        except PinExists as exc:
            errors.append(str(exc))
    return WarmReport(
        namespace=ns.id,
        num_tokens=len(token_ids),
        total=len(keys),
        already_local=len(local),
        remote=len(remote),
        prefetched=prefetched,
        produced=produced,
        still_missing=len(missing),
        pin=pinned,
        errors=tuple(errors),
        seconds=round(time.monotonic() - started, 3),
        hash_algo=algo,
        seed_fingerprint=scheme.seed_fingerprint,
    )


def _prefetch_checked(
    node: Node, remote: list[str], missing: list[str], errors: list[str], cancel: threading.Event | None
) -> int:
    """Prefetch `remote`; keys that turn out gone from the bucket move to `missing` (and `remote` shrinks)."""
    count = prefetch(node, remote, cancel=cancel)
    if count == len(remote) or (cancel is not None and cancel.is_set()):
        return count  # cancelled: the rest was not fetched, which says nothing about the bucket
    cached = node.cache.contains_many(remote)
    gone = [k for k, ok in zip(remote, cached, strict=True) if not ok]
    errors.append(f"{len(gone)} chunks listed in the bucket could not be fetched or verified")
    remote[:] = [k for k, ok in zip(remote, cached, strict=True) if ok]
    missing.extend(gone)
    return count
