"""The node's storage opened from settings: the object store (a local SeaweedFS when none is configured;
several regions as one `RegionalStore`) and the NVMe cache, its index migrated first. `kvstore.runtime` adds
the engine and the node agent on top; the agent's own process, the CLI's read-only tools and the benchmarks
open only these."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvstore.cache import NVMeCache
from kvstore.config import LOCAL_REGION, Settings, StoreSpec
from kvstore.metrics import EngineMetrics
from kvstore.node.private import make_private, private_dir
from kvstore.stores import ObjectStore, RegionalStore, open_store
from kvstore.stores.embedded import SeaweedServer, ensure_embedded_server

__all__ = [
    "EMBEDDED_BUCKET",
    "StoreAndCache",
    "open_cache",
    "open_embedded_store",
    "open_object_store",
    "store_and_cache",
]

log = logging.getLogger(__name__)

EMBEDDED_BUCKET = "kvstore"


def open_object_store(
    settings: Settings, *, subprefix: str = "", metrics: EngineMetrics | None = None
) -> tuple[ObjectStore, SeaweedServer | None]:
    """The configured store; with no `store_url`, a local SeaweedFS under `data_dir` (started if needed).
    With several stores in `store_url`, a `RegionalStore`: the first is this region, the rest read-only
    fallbacks whose hits, copies and errors count in `metrics`.

    `subprefix` narrows the store to a folder below the configured prefix (benchmarks use their own, so
    whatever they generate, and GC over it, never touches real cache data)."""
    suffix = f"/{subprefix.strip('/')}" if subprefix else ""
    stores = settings.stores
    if len(stores) == 1:
        return _open_region(stores[0], suffix), None
    if stores:
        return _open_regions(settings, stores, suffix, metrics), None
    store, server = open_embedded_store(settings, subprefix=subprefix)
    log.info(
        "no store_url configured: using the embedded S3 server at %s (data in %s)",
        server.endpoint,
        settings.data_dir / "s3",
    )
    return store, server


def open_embedded_store(settings: Settings, *, subprefix: str = "") -> tuple[ObjectStore, SeaweedServer]:
    """The embedded S3 server under `data_dir` (the one that runs, or a new one) and a store on its bucket."""
    suffix = f"/{subprefix.strip('/')}" if subprefix else ""
    server = ensure_embedded_server(settings.data_dir / "s3")
    try:
        store = open_store(
            f"s3://{EMBEDDED_BUCKET}{suffix}",
            endpoint=server.endpoint,
            access_key=server.access_key,
            secret_key=server.secret_key,
            session_token="",  # the caller's AWS_SESSION_TOKEN belongs to another account, not this server
        )
    except BaseException:
        server.stop()
        raise
    return store, server


def _open_region(spec: StoreSpec, suffix: str, **options: Any) -> ObjectStore:
    return open_store(
        spec.url.rstrip("/") + suffix,
        endpoint=spec.endpoint,
        access_key=spec.access_key.get_secret_value() if spec.access_key else None,
        secret_key=spec.secret_key.get_secret_value() if spec.secret_key else None,
        region=spec.region,
        **options,
    )


def _open_regions(
    settings: Settings, stores: list[StoreSpec], suffix: str, metrics: EngineMetrics | None
) -> RegionalStore:
    opened: list[ObjectStore] = []
    try:
        for spec in stores:
            options: dict[str, Any] = {}
            if opened and spec.url.lower().startswith("s3://"):
                # A remote request should end about when its caller stops waiting, freeing its thread.
                timeout = settings.remote_timeout_s
                options = {"connect_timeout": timeout, "read_timeout": timeout, "retries": 1}
            opened.append(_open_region(spec, suffix, **options))
        return RegionalStore(
            opened[0],
            [(spec.name or "", store) for spec, store in zip(stores[1:], opened[1:], strict=True)],
            local_name=stores[0].name or LOCAL_REGION,
            timeout_s=settings.remote_timeout_s,
            cooldown_s=settings.remote_cooldown_s,
            workers=settings.remote_workers,
            copy_queue_bytes=settings.remote_copy_queue_bytes,
            metrics=metrics,
        )
    except BaseException:
        for store in opened:
            store.close()
        raise


def open_cache(settings: Settings) -> NVMeCache:
    """The node's NVMe cache, its index migrated first if an older release made it (a no-op otherwise)."""
    from kvstore.migrations import migrate  # the migrations import the cache: imported late

    private_dir(settings.cache_dir)
    migrate(cache_dir=settings.cache_dir)
    cache = NVMeCache(
        settings.cache_dir,
        settings.cache_bytes,
        direct_io=settings.direct_io,
        direct_writes=settings.direct_writes,
        index_flush_s=settings.index_flush_s,
    )
    make_private(settings.cache_dir)  # one an older release made, and the index LMDB just created
    return cache


@dataclass
class StoreAndCache:
    """The store and the cache without an engine: for read-only tools, which start none of its threads."""

    store: ObjectStore
    cache: NVMeCache


@contextlib.contextmanager
def store_and_cache(settings: Settings) -> Iterator[StoreAndCache]:
    store, server = open_object_store(settings)
    try:
        cache = open_cache(settings)
        try:
            yield StoreAndCache(store, cache)
        finally:
            cache.close()
    finally:
        store.close()
        if server is not None:
            server.stop()
