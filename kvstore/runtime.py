"""Open the pieces of a node from settings: the object store (embedded if none is configured), the NVMe cache
and the engine. The CLI, the admin service and the vLLM tier all start here, so they agree on every name."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.cache import NVMeCache
from kvstore.config import Settings
from kvstore.embedded import SeaweedServer, ensure_embedded_server
from kvstore.engine import TieredStore
from kvstore.errors import StoreUnavailable
from kvstore.metrics import EngineMetrics
from kvstore.stores import ObjectStore, open_store

log = logging.getLogger(__name__)

EMBEDDED_BUCKET = "kvstore"


@dataclass
class Node:
    """What one process holds open: the store, the cache, the engine, and the embedded server if any."""

    settings: Settings
    store: ObjectStore
    cache: NVMeCache
    engine: TieredStore
    embedded: SeaweedServer | None = None

    def close(self) -> None:
        self.engine.close()
        self.cache.close()
        self.store.close()
        if self.embedded is not None:
            self.embedded.stop()


def open_object_store(settings: Settings, *, subprefix: str = "") -> tuple[ObjectStore, SeaweedServer | None]:
    """The configured store; with no `store_url`, a local SeaweedFS under `data_dir` (started if needed).

    `subprefix` narrows the store to a folder below the configured prefix (benchmarks use their own, so
    whatever they generate, and GC over it, never touches real cache data)."""
    suffix = f"/{subprefix.strip('/')}" if subprefix else ""
    if settings.store_url:
        store = open_store(
            settings.store_url.rstrip("/") + suffix,
            endpoint=settings.s3_endpoint,
            access_key=settings.access_key.get_secret_value() if settings.access_key else None,
            secret_key=settings.secret_key.get_secret_value() if settings.secret_key else None,
            region=settings.region,
        )
        return store, None
    server = ensure_embedded_server(settings.data_dir / "s3")
    log.info(
        "no store_url configured: using the embedded S3 server at %s (data in %s)",
        server.endpoint,
        settings.data_dir / "s3",
    )
    store = open_store(
        f"s3://{EMBEDDED_BUCKET}{suffix}",
        endpoint=server.endpoint,
        access_key=server.access_key,
        secret_key=server.secret_key,
    )
    return store, server


def open_node(settings: Settings, *, metrics: EngineMetrics | None = None, check_store: bool = True) -> Node:
    """Open store, cache and engine.

    `check_store=False` tolerates an unreachable store (the vLLM tier must start and serve from NVMe or
    recompute while S3 is down); bad credentials or a missing bucket still fail."""
    store, server = open_object_store(settings)
    try:
        try:
            store.check()
        except StoreUnavailable as exc:
            if check_store:
                raise
            log.warning("object store unreachable at start-up, continuing without it for now: %s", exc)
        cache = NVMeCache(settings.cache_dir, settings.cache_bytes)
    except BaseException:
        store.close()
        if server is not None:
            server.stop()
        raise
    engine = TieredStore(
        store,
        cache,
        codec=settings.codec_enum,
        upload_queue_bytes=settings.upload_queue_bytes,
        upload_workers=settings.upload_workers,
        io_workers=settings.io_workers,
        probe_hit_ttl_s=settings.probe_hit_ttl_s,
        probe_miss_ttl_s=settings.probe_miss_ttl_s,
        outage_cooldown_s=settings.outage_cooldown_s,
        metrics=metrics,
    )
    return Node(settings=settings, store=store, cache=cache, engine=engine, embedded=server)


@contextlib.contextmanager
def node(settings: Settings, *, metrics: EngineMetrics | None = None) -> Iterator[Node]:
    opened = open_node(settings, metrics=metrics)
    try:
        yield opened
    finally:
        opened.close()
