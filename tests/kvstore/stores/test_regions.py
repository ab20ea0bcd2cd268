"""RegionalStore against real S3 servers, with a TCP proxy in front of the remote region to slow or cut it.

What the proxy counts (connections, HTTP requests) is how these tests prove a path never called the remote;
nothing here asserts on timing.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from prometheus_client import CollectorRegistry

from kvstore.chunk import HEADER_BLOCK, encode
from kvstore.config import load_settings
from kvstore.metrics import EngineMetrics
from kvstore.storage import open_object_store
from kvstore.stores import RegionalStore, S3Options, S3Store, get_each_located, get_located
from kvstore.stores.base import Buffer
from tests.helpers import FakeClock
from tests.helpers import sample as strict_sample

if TYPE_CHECKING:
    from conftest import S3Server

pytestmark = pytest.mark.integration

_METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")
# Tests of a slow remote wait out this deadline; the rest give the remote time to answer on a loaded machine
# (CI once saw the shared server take 4 s, and 0.3 s then read as a dead region).
_SHORT_DEADLINE = 0.3
_DEADLINE = 10.0


class TcpProxy:
    """A loopback TCP proxy with a settable delay (before each client->server write) and a cut mode
    (connections are closed at once, open ones dropped). Counts connections and HTTP requests."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.delay = 0.0
        self._cut = False
        self.connections = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._open: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self, on: bool = True) -> None:
        self._cut = on
        if on:
            self._drop_all()

    def close(self) -> None:
        self._stopping.set()
        for thread in self._threads[:1]:
            thread.join(10)  # the accept loop: no new connections after this
        self._listener.close()
        self._drop_all()
        for thread in self._threads[1:]:
            thread.join(10)

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _drop_all(self) -> None:
        with self._lock:
            socks, self._open = list(self._open), set()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept_loop(self) -> None:
        self._listener.settimeout(0.1)  # closing a socket does not wake a blocked accept(); poll instead
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            with self._lock:
                self.connections += 1
            if self._cut:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, upstream))
            self._spawn(self._pump, client, upstream, True)
            self._spawn(self._pump, upstream, client, False)

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if from_client:
                    if data.startswith(_METHODS):
                        with self._lock:
                            self.requests += 1
                    if self.delay and self._stopping.wait(self.delay):
                        break
                if self._cut:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def chunk(i: int, key: str, size: int = 4096) -> bytes:
    return encode(key, bytes((i + j) % 251 for j in range(size))).to_bytes()


def chunk_key(tag: str = "") -> str:
    return f"ns_abc_r0/{uuid.uuid4().hex[:3]}/00_g0/{tag}{uuid.uuid4().hex}.bin"


def sample(metrics: EngineMetrics, name: str, region: str) -> float:
    return strict_sample(metrics, name, region=region)


def _host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.split("://", 1)[-1].rsplit(":", 1)
    return host, int(port)


def through(proxy: TcpProxy, server: S3Server, bucket: str, deadline: float) -> S3Store:
    """A store on `server`'s `bucket` reached through `proxy`, without retries. Its own requests end soon
    after the caller's `deadline`, so threads stuck on a slow remote free up quickly."""
    timeout = max(1.0, deadline)
    options = S3Options(connect_timeout=timeout, read_timeout=timeout, deadline=2 * timeout, retries=0)
    return S3Store(
        bucket,
        endpoint=proxy.endpoint,
        access_key=server.access_key,
        secret_key=server.secret_key,
        options=options,
    )


@contextlib.contextmanager
def _proxy(server: S3Server) -> Iterator[TcpProxy]:
    proxy = TcpProxy(_host_port(server.endpoint))
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def metrics() -> EngineMetrics:
    return EngineMetrics(CollectorRegistry())


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def local(s3_server: S3Server, s3_bucket: str) -> Iterator[S3Store]:
    """This region's bucket (direct access, for seeding and checking)."""
    with s3_server.store(s3_bucket) as store:
        yield store


@pytest.fixture
def remote_bucket(s3_server: S3Server) -> Iterator[str]:
    with s3_server.bucket() as bucket:
        yield bucket


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[TcpProxy]:
    with _proxy(s3_server) as running:
        yield running


@pytest.fixture
def remote(s3_server: S3Server, remote_bucket: str) -> Iterator[S3Store]:
    """The remote region's bucket, direct (for seeding); the RegionalStore reaches it through the proxy."""
    with s3_server.store(remote_bucket) as store:
        yield store


@pytest.fixture
def regional(
    request: pytest.FixtureRequest,
    s3_server: S3Server,
    s3_bucket: str,
    remote_bucket: str,
    proxy: TcpProxy,
    metrics: EngineMetrics,
    clock: FakeClock,
) -> Iterator[RegionalStore]:
    """Two buckets on the session server; the remote one behind the proxy. Tests of a slow remote ask for
    a short deadline through indirect parametrization."""
    deadline = getattr(request, "param", _DEADLINE)
    store = RegionalStore(
        s3_server.store(s3_bucket),
        [("eu", through(proxy, s3_server, remote_bucket, deadline))],
        timeout_s=deadline,
        cooldown_s=30.0,
        metrics=metrics,
        clock=clock,
    )
    with store:
        yield store


def test_local_hits_never_touch_the_remote(
    regional: RegionalStore, local: S3Store, remote: S3Store, proxy: TcpProxy, metrics: EngineMetrics
) -> None:
    key, both = chunk_key(), chunk_key()
    local.put(key, chunk(1, key))
    local.put(both, chunk(2, both))
    remote.put(both, chunk(3, both))
    proxy.delay = 30.0  # a remote this slow would stall any caller that waited on it
    assert get_located(regional, key) == (chunk(1, key), "local")
    assert regional.get(both) == chunk(2, both)  # local wins; a key already local is never copied
    assert regional.get_range(key, 64, 10) == chunk(1, key)[64:74]
    assert regional.exists_many([key, both]) == [True, True]
    assert proxy.connections == 0 and proxy.requests == 0
    assert regional.wait_copies(10)
    assert sample(metrics, "kvstore:region_copies_total", "eu") == 0


def get_all_located(
    store: RegionalStore,
    keys: Sequence[str],
    *,
    at_once: int = 8,
    wanted: Callable[[int], bool] = lambda _i: True,
) -> dict[int, tuple[bytes | None, str | None]]:
    """``get_each_located`` over ``keys``, tagged by position: each answer's bytes and region."""
    todo = iter(enumerate(keys))
    got: dict[int, tuple[bytes | None, str | None]] = {}

    def keep(i: int, blob: Buffer | None, region: str | None) -> None:
        assert i not in got  # one answer per key
        got[i] = (None if blob is None else bytes(blob), region)

    get_each_located(store, lambda: next(todo, None), keep, at_once=at_once, wanted=wanted)
    return got


def test_a_batch_asks_the_remote_only_for_what_the_local_region_lacks(
    regional: RegionalStore, local: S3Store, remote: S3Store, proxy: TcpProxy, metrics: EngineMetrics
) -> None:
    here, both, far, far_too, nowhere = (chunk_key() for _ in range(5))
    local.put(here, chunk(1, here))
    local.put(both, chunk(2, both))
    remote.put(both, chunk(3, both))
    remote.put(far, chunk(4, far))
    remote.put(far_too, chunk(5, far_too))
    assert regional.gets_many_at_once  # an S3 local region: the batch's GETs go together
    got = get_all_located(regional, [here, both, far, far_too, nowhere, "_meta/pins/p.json"])
    assert got == {
        0: (chunk(1, here), "local"),
        1: (chunk(2, both), "local"),
        2: (chunk(4, far), "eu"),
        3: (chunk(5, far_too), "eu"),
        4: (None, None),
        5: (None, None),  # meta objects are never read from a remote
    }
    assert proxy.requests == 3  # far, far_too and nowhere: one GET each, nothing else
    assert regional.wait_copies(30)
    assert local.get(far) == chunk(4, far) and local.get(far_too) == chunk(5, far_too)
    assert sample(metrics, "kvstore:region_copies_total", "eu") == 2


def test_a_batch_asks_the_remote_nothing_its_caller_no_longer_wants(
    regional: RegionalStore, remote: S3Store, proxy: TcpProxy
) -> None:
    """A chain of keys only in the remote but for a gap: nothing past the gap is asked of the remote once
    the caller learns of the gap (as `ChainFetch` does: a request cannot use a chunk past its first miss)."""
    keys = [chunk_key() for _ in range(6)]
    for i, key in enumerate(keys):
        if i != 2:
            remote.put(key, chunk(i, key))
    first_miss = [len(keys)]

    def wanted(i: int) -> bool:
        return i < first_miss[0]

    todo = iter(enumerate(keys))
    got: dict[int, tuple[bytes | None, str | None]] = {}

    def keep(i: int, blob: Buffer | None, region: str | None) -> None:
        got[i] = (None if blob is None else bytes(blob), region)
        if blob is None:
            first_miss[0] = min(first_miss[0], i)

    get_each_located(regional, lambda: next(todo, None), keep, at_once=1, wanted=wanted)
    assert got[0] == (chunk(0, keys[0]), "eu") and got[1] == (chunk(1, keys[1]), "eu")
    assert [got[i] for i in range(2, 6)] == [(None, None)] * 4  # every key answered, the rest unasked
    assert proxy.requests == 3


@pytest.mark.parametrize("regional", [_SHORT_DEADLINE], indirect=True)
def test_a_batch_with_a_slow_remote_ends_at_the_deadline(
    regional: RegionalStore, local: S3Store, remote: S3Store, proxy: TcpProxy, metrics: EngineMetrics
) -> None:
    here, far = chunk_key(), chunk_key()
    local.put(here, chunk(1, here))
    remote.put(far, chunk(2, far))
    proxy.delay = 30.0
    assert get_all_located(regional, [here, far]) == {0: (chunk(1, here), "local"), 1: (None, None)}
    assert regional.remote_available("eu") is False
    assert sample(metrics, "kvstore:region_errors_total", "eu") == 1
    asked = proxy.requests
    assert get_all_located(regional, [far]) == {0: (None, None)}  # cooling down: not asked
    assert proxy.requests == asked


def test_writes_lists_deletes_and_meta_stay_local(
    regional: RegionalStore, local: S3Store, remote: S3Store, proxy: TcpProxy
) -> None:
    written, meta = chunk_key(), "_meta/leases/gc"
    regional.put(written, chunk(4, written))
    assert regional.put_if_absent(meta, b"lease") is True
    assert remote.get(written) is None and remote.get(meta) is None
    assert [o.key for o in regional.list()] == [o.key for o in local.list()]
    # Meta objects are per region: a remote's lease or pin manifest is never read as ours.
    remote.put("_meta/pins/prompt.json", b"{}")
    assert regional.get("_meta/pins/prompt.json") is None
    assert regional.exists_many(["_meta/pins/prompt.json"]) == [False]
    regional.delete(written)
    assert local.get(written) is None
    assert proxy.requests == 0
    assert regional.url == local.url


@pytest.mark.slow
def test_remote_hit_is_served_and_copied_once(
    s3_server: S3Server, private_s3_server: S3Server, s3_bucket: str, local: S3Store, tmp_path: Path
) -> None:
    """Two servers: this region on the session server, the remote on a private one behind the proxy."""
    metrics = EngineMetrics(CollectorRegistry())
    with private_s3_server.bucket() as far, _proxy(private_s3_server) as proxy:
        seeder = private_s3_server.store(far)
        single, contended = chunk_key(), chunk_key()
        seeder.put(single, chunk(5, single))
        seeder.put(contended, chunk(6, contended))
        remote_store = through(proxy, private_s3_server, far, _DEADLINE)
        with RegionalStore(
            s3_server.store(s3_bucket), [("us-west", remote_store)], timeout_s=_DEADLINE, metrics=metrics
        ) as regional:
            assert regional.exists_many([single, chunk_key()]) == [True, False]
            assert get_located(regional, single) == (chunk(5, single), "us-west")
            assert regional.wait_copies(30)
            assert local.get(single) == chunk(5, single)
            asked = proxy.requests
            assert get_located(regional, single) == (chunk(5, single), "local")
            assert proxy.requests == asked  # now local: the remote is not asked again

            # Many concurrent misses of one key: every caller is served, the key is copied once.
            barrier = threading.Barrier(8)
            results: list[bytes | None] = []

            def read() -> None:
                barrier.wait()
                results.append(regional.get(contended))

            threads = [threading.Thread(target=read) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert results == [chunk(6, contended)] * 8
            assert regional.wait_copies(30)
            assert local.get(contended) == chunk(6, contended)
            assert sample(metrics, "kvstore:region_copies_total", "us-west") == 2
            assert seeder.get(single) == chunk(5, single)  # the remote is read, never written
        seeder.close()


@pytest.mark.parametrize("regional", [_SHORT_DEADLINE], indirect=True)
def test_slow_remote_past_the_deadline_is_a_miss_and_is_skipped(
    regional: RegionalStore, remote: S3Store, proxy: TcpProxy, metrics: EngineMetrics
) -> None:
    key = chunk_key()
    remote.put(key, chunk(7, key))
    proxy.delay = 30.0
    assert regional.get(key) is None  # the deadline answered, not the remote
    assert regional.remote_available("eu") is False
    assert sample(metrics, "kvstore:region_errors_total", "eu") == 1
    asked = proxy.requests
    # While the breaker is open the dead region costs nothing: no request, no error, no wait.
    assert regional.get(key) is None
    assert regional.exists_many([key]) == [False]
    assert regional.get_range(key, 0, 8) is None
    assert proxy.requests == asked
    assert sample(metrics, "kvstore:region_errors_total", "eu") == 1


# A cut fails at once, so the default deadline serves here; on a loaded machine the first GET after the cut
# (a new connection through the proxy) once took longer than 0.3 s, and the test took that for "not back".
def test_cut_remote_fails_clean_and_comes_back_after_the_cooldown(
    regional: RegionalStore,
    local: S3Store,
    remote: S3Store,
    proxy: TcpProxy,
    metrics: EngineMetrics,
    clock: FakeClock,
) -> None:
    key = chunk_key()
    remote.put(key, chunk(8, key))
    proxy.cut()
    assert regional.exists_many([key]) == [False]
    assert sample(metrics, "kvstore:region_errors_total", "eu") == 1
    assert regional.remote_available("eu") is False
    proxy.cut(False)
    assert regional.get(key) is None  # back, but still cooling down
    clock.now += 31
    assert regional.remote_available("eu") is True
    assert get_located(regional, key) == (chunk(8, key), "eu")
    assert regional.wait_copies(30)
    assert local.get(key) == chunk(8, key)
    assert sample(metrics, "kvstore:region_copies_total", "eu") == 1
    assert sample(metrics, "kvstore:region_errors_total", "eu") == 1


def test_corrupt_remote_object_is_never_copied(
    regional: RegionalStore, local: S3Store, remote: S3Store, metrics: EngineMetrics
) -> None:
    key = chunk_key()
    bad = bytearray(chunk(9, key))
    bad[HEADER_BLOCK] ^= 0xFF
    remote.put(key, bytes(bad))
    # The store hands bytes on unverified (the engine verifies before use); it never vouches for them.
    assert regional.get(key) == bytes(bad)
    assert regional.wait_copies(30)
    assert local.get(key) is None
    assert sample(metrics, "kvstore:region_copies_total", "eu") == 0


def test_copies_stay_within_their_byte_budget(
    s3_server: S3Server, s3_bucket: str, remote_bucket: str, local: S3Store, remote: S3Store
) -> None:
    key = chunk_key()
    remote.put(key, chunk(10, key))
    with RegionalStore(
        s3_server.store(s3_bucket), [("eu", s3_server.store(remote_bucket))], copy_queue_bytes=1024
    ) as regional:
        assert regional.get(key) == chunk(10, key)  # served, but too big to copy within the budget
        assert regional.wait_copies(30)
    assert local.get(key) is None


def test_open_object_store_builds_regions_from_settings(
    s3_server: S3Server, s3_bucket: str, remote_bucket: str, remote: S3Store, proxy: TcpProxy
) -> None:
    key = chunk_key()
    remote.put(key, chunk(11, key))
    settings = load_settings(
        store_url=[
            f"s3://{s3_bucket}",
            {"url": f"s3://{remote_bucket}", "name": "eu", "endpoint": proxy.endpoint},
        ],
        s3_endpoint=s3_server.endpoint,
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
        remote_timeout_s=5.0,
    )
    metrics = EngineMetrics(CollectorRegistry())
    store, server = open_object_store(settings, metrics=metrics)
    with store:
        assert server is None and isinstance(store, RegionalStore)
        assert store.regions == ["local", "eu"] and store.url == f"s3://{s3_bucket}"
        assert s3_server.secret_key not in repr(store)
        assert get_located(store, key) == (chunk(11, key), "eu")
        assert proxy.requests >= 1
        assert store.wait_copies(30)
        assert sample(metrics, "kvstore:region_copies_total", "eu") == 1
