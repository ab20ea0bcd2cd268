"""Where a benchmark's tier writes: a private prefix of the configured store, or of the embedded S3 server
when none is configured, which the benchmark removes at its end (it never touches real cache data)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvstore.config import Settings
from kvstore.connector.bench.cores import server_apart
from kvstore.connector.harness.s3_requests import RequestCounts, read_request_counts
from kvstore.connector.harness.slow_link import LinkShape, SlowLink
from kvstore.errors import ConfigError, KVStoreError
from kvstore.storage import EMBEDDED_BUCKET, open_object_store
from kvstore.stores.embedded import SeaweedServer

__all__ = ["StoreTarget", "bench_target", "cores_for", "environment"]


@dataclass(frozen=True)
class StoreTarget:
    """A store URL under a private prefix, its S3 endpoint, what a tier's process needs in its environment
    (empty: the caller's own), and the keys a baseline's raw client signs with."""

    store_url: str
    endpoint: str | None
    env: Mapping[str, str] = field(default_factory=dict)
    server_pid: int | None = None  # a local S3 server's process, to account its CPU time
    access_key: str = ""
    secret_key: str = ""
    metrics_url: str | None = None  # a local SeaweedFS's counters: the S3 requests a run made
    # The node's own embedded server (what a node with no endpoint configured runs), not a store standing for
    # one that other nodes share.
    own_server: bool = False
    # Where that local server keeps its objects: benchmarks drop them from the page cache before timing reads
    # (a bucket's objects are on its disks, not in this machine's RAM).
    server_dir: Path | None = None
    # `endpoint` is a link of this shape to the server (`SlowLink`), every method's requests through it.
    link: str = ""
    link_pid: int | None = None  # that link's proxy process
    # The local server itself, where this benchmark started it (its start-up maintenance: `settle`).
    server: SeaweedServer | None = field(default=None, compare=False, repr=False)

    def settle(self, timeout_s: float = 120.0) -> None:
        """Wait until the local server's start-up maintenance is over (a vacuum pass and its shell take CPU
        and, at 20 s, a core of a two-core machine): what a benchmark times in its own process comes after."""
        if self.server is not None:
            self.server.wait_maintained(timeout_s)

    @property
    def is_s3(self) -> bool:
        return self.store_url.startswith("s3://")

    def requests(self) -> RequestCounts | None:
        """What the server was asked about this target's bucket so far (None: it cannot say)."""
        if self.metrics_url is None:
            return None
        return read_request_counts(self.metrics_url, bucket=self.bucket_and_prefix[0])

    def obj_tier(self, prefix: str) -> tuple[dict[str, Any], dict[str, str]]:
        """vLLM's own object-store tier (`obj`, NIXL's OBJ plugin) on this target under ``prefix``: its
        `secondary_tiers` entry and what its vLLM process needs in the environment. NIXL's agent dies at
        its first finished transfer without telemetry, and its AWS SDK would probe EC2 metadata."""
        bucket, run_prefix = self.bucket_and_prefix
        endpoint = urlsplit(self.endpoint or "https://s3.amazonaws.com")
        entry = {
            "type": "obj",
            "prefix": f"{run_prefix}/{prefix}".strip("/"),
            "store_config": {
                "bucket": bucket,
                "endpoint_override": endpoint.netloc,
                "access_key": self.access_key,
                "secret_key": self.secret_key,
                "region": "us-east-1",
                "scheme": endpoint.scheme,
            },
        }
        env = {
            **self.env,
            "NIXL_TELEMETRY_ENABLE": "y",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_REGION": "us-east-1",
        }
        return entry, env

    @property
    def bucket_and_prefix(self) -> tuple[str, str]:
        bucket, _, prefix = self.store_url.removeprefix("s3://").partition("/")
        return bucket, prefix


@contextlib.contextmanager
def bench_target(settings: Settings, name: str, link: LinkShape | None = None) -> Iterator[StoreTarget]:
    """A fresh prefix `bench-<name>-<ns>` of the configured store; its objects are deleted at the end and an
    embedded server this started is stopped. With ``link``, every request goes through a `SlowLink` of that
    shape to the server (ConfigError where the store is not S3 on plain http: the embedded server's)."""
    run_prefix = f"bench-{name}-{time.time_ns()}"
    store, server = open_object_store(settings, subprefix=run_prefix)
    try:
        if server is not None:
            credentials = {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}
            target = StoreTarget(
                f"s3://{EMBEDDED_BUCKET}/{run_prefix}",
                server.endpoint,
                credentials,
                server.pid,
                server.access_key,
                server.secret_key,
                server.metrics_url,
                own_server=True,
                server_dir=server.data_dir,
                server=server,
            )
        else:
            target = StoreTarget(
                f"{settings.local_store_url.rstrip('/')}/{run_prefix}",
                settings.s3_endpoint,
                access_key=settings.access_key.get_secret_value() if settings.access_key else "",
                secret_key=settings.secret_key.get_secret_value() if settings.secret_key else "",
            )
        if link is None:
            yield target
        else:
            if not target.is_s3 or not (target.endpoint or "").startswith("http://"):
                raise ConfigError(f"a link ({link}) goes to S3 on plain http, not {target.store_url}")
            with SlowLink(target.endpoint or "", link) as slow:
                yield dataclasses.replace(target, endpoint=slow.endpoint, link=str(link), link_pid=slow.pid)
    finally:
        with contextlib.suppress(KVStoreError):  # best effort: a store gone down keeps its leftovers
            store.delete_many([info.key for info in store.list()])
        store.close()
        if server is not None:
            server.stop()


def cores_for(
    target: StoreTarget | None, server_core: bool
) -> contextlib.AbstractContextManager[tuple[set[int], set[int]]]:
    """`--server-core`: `cores.server_apart` for the target's local server and the link before it, yielding
    (the server's cores, the benchmark's); without it, a block that moves nothing (two empty sets).
    `CoresUnavailable` at once when it cannot be done."""
    if not server_core:
        return contextlib.nullcontext((set[int](), set[int]()))
    if target is None:
        return server_apart(None)
    return server_apart(target.server_pid, [target.link_pid] if target.link_pid is not None else [])


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in `os.environ` for the block (a tier in this process reads its credentials from there, like
    any vLLM process), the previous values back afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
