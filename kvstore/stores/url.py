"""Open a store from a URL: `s3://bucket/prefix`, `file:///abs/path`, `memory://name`."""

from __future__ import annotations

import os
import threading
from typing import Any
from urllib.parse import unquote, urlsplit

from kvstore.errors import ConfigError
from kvstore.stores.base import ObjectStore
from kvstore.stores.local import LocalStore
from kvstore.stores.memory import MemoryStore
from kvstore.stores.s3 import S3Options, S3Store

__all__ = ["open_store"]

# memory://name opens the same store each time within a process, so two components can share one.
_memory_stores: dict[str, MemoryStore] = {}
_memory_lock = threading.Lock()


def open_store(
    url: str,
    *,
    endpoint: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    region: str | None = None,
    session_token: str | None = None,
    **options: Any,
) -> ObjectStore:
    """Open the store `url` names. Extra `options` go to the backend (for S3: `S3Options` fields).

    The S3 endpoint comes from the argument, else `KVSTORE_S3_ENDPOINT`, else `AWS_ENDPOINT_URL`, else AWS;
    an `http://` endpoint means plain HTTP; `session_token` None means `AWS_SESSION_TOKEN`, "" none.
    Malformed URLs raise `ConfigError` saying what is wrong.
    """
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise ConfigError(f"store URL {url!r}: query strings and fragments are not supported")
    scheme = parts.scheme.lower()
    if scheme == "s3":
        return _open_s3(
            url, parts.netloc, parts.path, endpoint, access_key, secret_key, region, session_token, options
        )
    if options or endpoint or access_key or secret_key or region or session_token:
        raise ConfigError(f"store URL {url!r}: endpoint, credentials and options apply only to s3:// stores")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"store URL {url!r}: file URLs need an absolute path, e.g. file:///var/kv")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ConfigError(f"store URL {url!r}: file URLs need an absolute path, e.g. file:///var/kv")
        try:
            return LocalStore(path)
        except OSError as exc:  # e.g. the directory cannot be created on a read-only file system
            raise ConfigError(f"store URL {url!r}: cannot create {path}: {exc.strerror or exc}") from None
    if scheme == "memory":
        name = parts.netloc + parts.path
        with _memory_lock:
            return _memory_stores.setdefault(name, MemoryStore(name))
    raise ConfigError(f"store URL {url!r}: unknown scheme {parts.scheme!r}; use s3://, file:// or memory://")


def _open_s3(
    url: str,
    bucket: str,
    path: str,
    endpoint: str | None,
    access_key: str | None,
    secret_key: str | None,
    region: str | None,
    session_token: str | None,
    options: dict[str, Any],
) -> S3Store:
    if not bucket:
        raise ConfigError(f"store URL {url!r}: missing bucket, expected s3://bucket/prefix")
    if "@" in bucket or ":" in bucket:
        raise ConfigError(f"store URL {url!r}: put credentials and endpoint in settings, not in the URL")
    prefix = unquote(path).strip("/")
    if "//" in prefix or any(seg in (".", "..") for seg in prefix.split("/") if prefix):
        raise ConfigError(f"store URL {url!r}: prefix has an empty, '.' or '..' segment")
    endpoint = endpoint or os.environ.get("KVSTORE_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL") or None
    try:
        s3_options = S3Options(**options)
    except TypeError as exc:
        raise ConfigError(f"store URL {url!r}: unknown S3 option: {exc}") from exc
    return S3Store(
        bucket,
        prefix,
        endpoint=endpoint,
        access_key=access_key,
        secret_key=secret_key,
        region=region,
        session_token=session_token,
        options=s3_options,
    )
