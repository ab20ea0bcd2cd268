"""Pins: named manifests of chunk keys in the bucket; nodes keep them out of eviction, GC never deletes them.

A manifest lives at `_meta/pins/<name>.json`::

    {"name", "namespace": <id>, "namespace_fields": {...}, "keys": [chunk keys],
     "created_at": <unix s>, "expires_at": <unix s> | null}

The bucket is the source of truth: `kvstore.pin_sync` brings a node's NVMe pins in line with it, and GC reads
it through `PinView`. A pin's keys are hashed exactly as vLLM does (`kvstore.hashing.chunk_keys`) from token
ids, which come from the engine's own tokenizer (`kvstore.vllm_api`) or a model directory (`kvstore.prompts`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.cache.records import MAX_KEY_BYTES, encode_key
from kvstore.errors import CacheError, ConfigError, KVStoreError
from kvstore.keys import Namespace
from kvstore.layout import CONFIG_FILENAME, PIN_DELETE_PREFIX, PIN_PREFIX
from kvstore.pin_fence import fenced_pin_write
from kvstore.stores.base import ObjectStore

__all__ = [
    "NAMESPACE_ID_PATTERN",
    "NamespaceNotFound",
    "PinExists",
    "PinManifest",
    "PinNotFound",
    "PinView",
    "check_cache_keys",
    "create_pin",
    "delete_pin",
    "get_pin",
    "invalid_text",
    "list_pins",
    "load_namespace",
    "pinned_keys",
    "present_chunks",
    "validate_pin_name",
]

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
# `<model>_<sha12>` (`Namespace.id`): one object key segment, so no '/', NUL or control characters, and short
# enough that every chunk key below it stays within S3's 1024-byte key limit.
NAMESPACE_ID_PATTERN = r"[^/\x00-\x1f\x7f]{1,200}_[0-9a-f]{12}"
_NAMESPACE_ID_RE = re.compile(NAMESPACE_ID_PATTERN)


class PinNotFound(KVStoreError, LookupError):
    """No pin manifest has that name."""


class PinExists(KVStoreError):
    """A live pin manifest already has that name (delete it first)."""


class NamespaceNotFound(KVStoreError, LookupError):
    """The bucket holds no `<id>/config.json` for the namespace id."""


def validate_pin_name(name: str) -> str:
    # '.' and '..' would pass the pattern but cannot be object key segments.
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise ConfigError(f"pin name {name!r} is invalid: use 1-128 characters from [A-Za-z0-9._-]")
    return name


def invalid_text(value: Any) -> str | None:
    """Where a JSON-like value holds text that UTF-8 cannot encode (a lone surrogate, which JSON's `\\ud800`
    escape makes out of valid input): a path such as `messages[0].content`, or `None` if all text is valid.
    Such text cannot be stored, hashed or answered, so it is refused on the way in."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:  # no recursion: a deeply nested request must not overflow the stack
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return path or "the value"
        elif isinstance(item, dict):
            for key, sub in item.items():
                if isinstance(key, str) and invalid_text(key) is not None:
                    return f"{path}.<a key>" if path else "<a key>"
                stack.append((f"{path}.{key}" if path else str(key), sub))
        elif isinstance(item, list | tuple):
            stack.extend((f"{path}[{i}]", sub) for i, sub in enumerate(item))
    return None


def check_cache_keys(keys: Sequence[str]) -> None:
    """`ConfigError` if a chunk key is too long for the NVMe cache's index (`MAX_KEY_BYTES`): such a key
    could be neither pinned nor cached on any node, so a pin or warm request naming one is refused."""
    for key in keys:
        try:
            encode_key(key)
        except CacheError:
            raise ConfigError(
                f"chunk keys of this namespace are {len(key.encode())} bytes, longer than the NVMe cache's "
                f"{MAX_KEY_BYTES}-byte key limit (a shorter model name makes shorter keys)"
            ) from None


def _manifest_key(name: str) -> str:
    return f"{PIN_PREFIX}{validate_pin_name(name)}.json"


@dataclass(frozen=True)
class PinManifest:
    name: str
    namespace: str
    namespace_fields: Mapping[str, Any]
    keys: tuple[str, ...]
    created_at: float
    expires_at: float | None = None

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (time.time() if now is None else now) >= self.expires_at

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "namespace": self.namespace,
            "namespace_fields": dict(self.namespace_fields),
            "keys": list(self.keys),
            "created_at": self.created_at,
            "expires_at": self.expires_at,
        }

    def encode(self) -> bytes:
        # Compact: a manifest is read by GC and every node, and its size should follow the keys it names.
        return json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> PinManifest:
        try:
            doc = json.loads(raw)
            where = invalid_text(doc)
            if where is not None:
                raise ValueError(f"text at {where} is not valid Unicode")
            expires = doc.get("expires_at")
            return cls(
                name=validate_pin_name(doc["name"]),
                namespace=str(doc["namespace"]),
                namespace_fields=dict(doc["namespace_fields"]),
                keys=tuple(str(k) for k in doc["keys"]),
                created_at=float(doc["created_at"]),
                expires_at=None if expires is None else float(expires),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"malformed pin manifest: {exc}") from None


# -- manifests --------------------------------------------------------------------------------------------


def create_pin(
    store: ObjectStore,
    name: str,
    namespace: Namespace,
    chunk_keys: Sequence[str],
    ttl_seconds: float | None = None,
) -> PinManifest:
    """Write a new manifest; `PinExists` if a live one has the name (an expired one is replaced)."""
    key = _manifest_key(name)
    if ttl_seconds is not None and ttl_seconds <= 0:
        raise ConfigError(f"ttl_seconds must be positive, got {ttl_seconds}")
    prefix = f"{namespace.id}_r"
    foreign = [k for k in chunk_keys if not k.startswith(prefix)]
    if foreign:
        raise ConfigError(
            f"{len(foreign)} keys do not belong to namespace {namespace.id}, e.g. {foreign[0]!r}"
        )
    check_cache_keys(chunk_keys)
    where = invalid_text(namespace.fields())
    if where is not None:
        raise ConfigError(f"namespace field {where} is not valid Unicode text")
    now = time.time()
    manifest = PinManifest(
        name=name,
        namespace=namespace.id,
        namespace_fields=namespace.fields(),
        keys=tuple(dict.fromkeys(chunk_keys)),  # de-duplicated, order kept
        created_at=now,
        expires_at=None if ttl_seconds is None else now + ttl_seconds,
    )
    encoded = manifest.encode()

    def write() -> PinManifest:
        if store.put_if_absent(key, encoded):
            return manifest
        existing = _read(store, key)
        if existing is not None and not existing.expired(now):
            raise PinExists(f"pin {name!r} already exists")
        # Expired (or vanished meanwhile): replacing it is what its owner would get after GC anyway.
        store.put(key, encoded)
        return manifest

    # Through the fence, so that a GC running now cannot delete a chunk of this manifest once it exists.
    return fenced_pin_write(store, write)


def _read(store: ObjectStore, key: str) -> PinManifest | None:
    raw = store.get(key)
    return None if raw is None else PinManifest.decode(raw)


def get_pin(store: ObjectStore, name: str) -> PinManifest:
    manifest = _read(store, _manifest_key(name))
    if manifest is None:
        raise PinNotFound(f"pin {name!r} not found")
    return manifest


def _iter_manifests(store: ObjectStore) -> Iterator[PinManifest]:
    for info in store.list(PIN_PREFIX):
        if not info.key.endswith(".json"):
            continue
        raw = store.get(info.key)
        if raw is None:  # deleted between list and get
            continue
        try:
            yield PinManifest.decode(raw)
        except ConfigError as exc:
            # One bad object must not unpin the whole fleet; it is reported, not fatal.
            log.warning("skipping %s: %s", info.key, exc)


def list_pins(store: ObjectStore, *, include_expired: bool = True) -> list[PinManifest]:
    now = time.time()
    return [m for m in _iter_manifests(store) if include_expired or not m.expired(now)]


# A delete that lost the claim on a manifest waits this long for the winner to remove it; a manifest still
# there afterwards was left by a winner that died between its claim and its delete, and is removed anyway.
_DELETE_WAIT_S = 5.0
_CLAIM_KEEP_S = 86_400.0  # delete claims older than this are pruned


def delete_pin(store: ObjectStore, name: str) -> None:
    """Delete the manifest; `PinNotFound` if there is none, or if a concurrent delete of the same manifest
    won: of racing deletes exactly one succeeds. Each claims the version it read, create-only, at
    `_meta/pin-deletes/<name>/<sha>`; only the winner deletes (a manifest created later under the name is
    another version, with a claim of its own)."""
    key = _manifest_key(name)
    raw = store.get(key)
    if raw is None:
        raise PinNotFound(f"pin {name!r} not found")
    claims = f"{PIN_DELETE_PREFIX}{name}/"
    if not store.put_if_absent(f"{claims}{hashlib.sha256(raw).hexdigest()[:32]}", b""):
        if _removed_within(store, key, raw, _DELETE_WAIT_S):
            raise PinNotFound(f"pin {name!r} not found (a concurrent request deleted it)")
        log.warning("pin %r: the delete that claimed it never finished; deleting it here", name)
    store.delete(key)
    cutoff = time.time() - _CLAIM_KEEP_S
    old = [info.key for info in store.list(claims) if info.last_modified < cutoff]
    if old:
        store.delete_many(old)


def _removed_within(store: ObjectStore, key: str, raw: bytes, wait_s: float) -> bool:
    """Whether the object at `key` stops holding `raw` (deleted or replaced) within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while store.get(key) == raw:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def pinned_keys(store: ObjectStore) -> set[str]:
    """Every chunk key named by a non-expired manifest (what GC must keep, what nodes must hold)."""
    out: set[str] = set()
    for manifest in list_pins(store, include_expired=False):
        out.update(manifest.keys)
    return out


# A manifest written this recently may have been replaced within the same second of `last_modified` (listings
# carry whole seconds), so its listing entry cannot prove it unchanged: `PinView` reads it again.
_RECENT_S = 10.0


class PinView:
    """The chunk keys of the bucket's live pin manifests, for GC to re-read before every delete batch.

    `refresh()` lists `_meta/pins/` and reads only the manifests that are new or whose listing entry changed
    (or that were written in the last few seconds), so a re-read costs a listing, not every manifest. Keys
    only accumulate: a manifest that expires or is deleted during the run keeps protecting its chunks until
    the next run, which errs on the side of keeping."""

    def __init__(self, store: ObjectStore, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._clock = clock
        self._seen: dict[str, tuple[int, float]] = {}
        self.keys: set[str] = set()
        self._live: set[str] = set()

    @property
    def manifests(self) -> int:
        """How many live manifests the view has read (each counted once)."""
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def refresh(self) -> None:
        now = self._clock()
        for info in self._store.list(PIN_PREFIX):
            if not info.key.endswith(".json"):
                continue
            signature = (info.size, info.last_modified)
            if self._seen.get(info.key) == signature and now - info.last_modified > _RECENT_S:
                continue
            raw = self._store.get(info.key)
            if raw is None:  # deleted between list and get
                continue
            self._seen[info.key] = signature
            try:
                manifest = PinManifest.decode(raw)
            except ConfigError as exc:
                log.warning("skipping %s: %s", info.key, exc)
                continue
            if not manifest.expired(now):
                self._live.add(info.key)
                self.keys.update(manifest.keys)


# -- namespaces --------------------------------------------------------------------------------


def load_namespace(store: ObjectStore, namespace_id: str, rank: int = 0) -> Namespace:
    """The namespace a tier published as `<id>/config.json`; `NamespaceNotFound` if none did."""
    if not _NAMESPACE_ID_RE.fullmatch(namespace_id):
        raise ConfigError(f"namespace id {namespace_id!r} is invalid: expected <model>_<12 hex digits>")
    raw = store.get(f"{namespace_id}/{CONFIG_FILENAME}")
    if raw is None:
        raise NamespaceNotFound(f"namespace {namespace_id!r} not found: no {namespace_id}/{CONFIG_FILENAME}")
    try:
        fields = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{namespace_id}/{CONFIG_FILENAME} is not JSON: {exc}") from None
    namespace = Namespace.from_fields(fields, rank=rank)
    if namespace.id != namespace_id:
        raise ConfigError(f"{namespace_id}/{CONFIG_FILENAME} describes namespace {namespace.id}, not itself")
    return namespace


def present_chunks(store: ObjectStore, keys: Sequence[str], *, batch: int = 1000) -> int:
    """How many of `keys` the bucket holds now (a pin's chunks exist only once an engine stored them)."""
    return sum(sum(store.exists_many(list(keys[i : i + batch]))) for i in range(0, len(keys), batch))
