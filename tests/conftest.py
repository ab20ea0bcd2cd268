"""Root fixtures: a real S3 server for the whole session, fresh buckets and stores per test.

The server is, in order of preference: an external endpoint from `KVSTORE_TEST_S3_ENDPOINT` (+ `_ACCESS_KEY`,
`_SECRET_KEY`), MinIO in a container when a Docker daemon answers, else a private SeaweedFS (`weed mini`).
Tests that stop a server use `private_s3_server`, their own SeaweedFS, so nobody else's server goes away.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from minio import Minio
from minio.deleteobjects import DeleteObject
from prometheus_client import CollectorRegistry

from kvstore.config import load_settings
from kvstore.connector.harness.s3_requests import RequestCounts, read_request_counts
from kvstore.metrics import EngineMetrics
from kvstore.runtime import Node, open_node
from kvstore.stores.embedded import SeaweedServer
from kvstore.stores.s3 import S3Store
from tests.helpers import KVEventSubscriber, vllm_expected


@dataclass
class S3Server:
    """What tests need from a server: where it is, how to sign, and (maybe) how to stop it."""

    endpoint: str
    access_key: str
    secret_key: str
    kind: str
    seaweed: SeaweedServer | None = field(default=None, repr=False)  # a server of the fixtures' own

    def _own(self, what: str) -> SeaweedServer:
        if self.seaweed is None:
            pytest.skip(f"cannot {what} the {self.kind} S3 server")
        return self.seaweed

    def stop(self) -> None:
        self._own("stop").stop()

    def start(self) -> None:
        self._own("start").start()

    def freeze(self, on: bool = True) -> None:
        """SIGSTOP the server's processes (`on`), or let them go on: frozen, it still accepts connections (the
        kernel does) and never answers."""
        pid = self._own("freeze").pid
        assert pid is not None, "the server is not running"
        os.killpg(pid, signal.SIGSTOP if on else signal.SIGCONT)
        if on:  # the signal is delivered, not yet acted on: a request sent at once could still be answered
            deadline = time.monotonic() + 5
            while not _group_stopped(pid):
                assert time.monotonic() < deadline, "the server did not stop within 5 s"
                time.sleep(0.005)

    def client(self) -> Minio:
        secure = self.endpoint.startswith("https://")
        host = self.endpoint.split("://", 1)[-1]
        return Minio(host, self.access_key, self.secret_key, secure=secure, region="us-east-1")

    def store(self, bucket: str, prefix: str = "", **kwargs: Any) -> S3Store:
        kwargs.setdefault("access_key", self.access_key)
        kwargs.setdefault("secret_key", self.secret_key)
        return S3Store(bucket, prefix, endpoint=self.endpoint, **kwargs)

    @contextlib.contextmanager
    def bucket(self) -> Iterator[str]:
        """A new, uniquely named bucket on this server; emptied and removed afterwards."""
        yield from _make_bucket(self)

    def requests(self, bucket: str) -> RequestCounts:
        """What the server was asked about ``bucket`` so far, counted by the server itself (SeaweedFS's
        counters; a test that needs them skips on another server)."""
        url = self._own("count the requests of").metrics_url
        assert url is not None, "the server has not started"
        return read_request_counts(url, bucket=bucket)


def _docker_answers() -> bool:
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env(timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # no SDK, no socket, no daemon: all mean "no Docker"
        return False


@contextlib.contextmanager
def _minio_container() -> Iterator[S3Server]:
    from testcontainers.minio import MinioContainer  # type: ignore[import-untyped]

    with MinioContainer() as container:
        config = container.get_config()
        yield S3Server(f"http://{config['endpoint']}", config["access_key"], config["secret_key"], "minio")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    endpoint = os.environ.get("KVSTORE_TEST_S3_ENDPOINT")
    if endpoint:
        yield S3Server(
            endpoint,
            os.environ.get("KVSTORE_TEST_S3_ACCESS_KEY", ""),
            os.environ.get("KVSTORE_TEST_S3_SECRET_KEY", ""),
            "external",
        )
        return
    if _docker_answers():
        with _minio_container() as server:
            yield server
        return
    seaweed = SeaweedServer(tmp_path_factory.mktemp("seaweed"))
    seaweed.start()
    try:
        yield S3Server(seaweed.endpoint, seaweed.access_key, seaweed.secret_key, "seaweedfs", seaweed)
    finally:
        seaweed.stop()


@pytest.fixture
def private_s3_server(tmp_path: Path) -> Iterator[S3Server]:
    """A SeaweedFS of this test's own, for tests that stop or restart the server."""
    seaweed = SeaweedServer(tmp_path / "seaweed")
    seaweed.start()
    try:
        yield S3Server(seaweed.endpoint, seaweed.access_key, seaweed.secret_key, "seaweedfs", seaweed)
    finally:
        seaweed.stop(kill=True)


def _empty(client: Minio, bucket: str, prefix: str = "") -> None:
    listing = client.list_objects(bucket, prefix=prefix, recursive=True)
    names = (DeleteObject(o.object_name) for o in listing if o.object_name)
    for _ in client.remove_objects(bucket, names):
        pass


def _empty_and_remove(client: Minio, bucket: str) -> None:
    _empty(client, bucket)
    client.remove_bucket(bucket)


def _make_bucket(server: S3Server) -> Iterator[str]:
    """Create a uniquely named bucket on `server`, yield its name, then empty and delete it."""
    client = server.client()
    bucket = f"kvt-{uuid.uuid4().hex[:16]}"
    client.make_bucket(bucket)
    try:
        yield bucket
    finally:
        # A server of the fixtures' own that a test left stopped goes with its directory: asking it would
        # only wait out the client's retries (6 s).
        if server.seaweed is None or server.seaweed.running:
            with contextlib.suppress(Exception):  # a test may have stopped its server on purpose
                _empty_and_remove(client, bucket)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny local model (tokenizer, chat template, random weights), built once per run (~5 s); tests only
    read it."""
    from kvstore.connector.harness.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session", autouse=True)
def _vllm_imported_once() -> Iterator[None]:
    """Every vLLM engine and server the tests start is a fork of one process that imported vLLM (started at
    the first of them): about 10 s less per start."""
    from kvstore.connector.harness.forkserver import forked_vllm

    with forked_vllm():
        yield


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    """A new bucket of this test's own (for tests of whole buckets)."""
    yield from _make_bucket(s3_server)


@pytest.fixture(scope="session")
def _stores_bucket(s3_server: S3Server) -> Iterator[str]:
    yield from _make_bucket(s3_server)


@pytest.fixture
def s3_store(s3_server: S3Server, _stores_bucket: str) -> Iterator[S3Store]:
    """A store under a new prefix of its own, in a bucket every test's `s3_store` shares: SeaweedFS takes
    ~0.2 s for the first write to a new bucket (a collection and its volumes), nothing for a new prefix.
    What the test left under its prefix is deleted afterwards."""
    prefix = f"p-{uuid.uuid4().hex[:8]}"
    with s3_server.store(_stores_bucket, prefix) as store:
        yield store
    with contextlib.suppress(Exception):  # a test may have stopped its server on purpose
        _empty(s3_server.client(), _stores_bucket, prefix + "/")


@pytest.fixture
def private_s3_store(private_s3_server: S3Server) -> Iterator[S3Store]:
    """A store on this test's own server (see `private_s3_server`), for outage tests."""
    with private_s3_server.bucket() as bucket, private_s3_server.store(bucket) as store:
        yield store


# Fixtures that reach a real S3 server: a test using any of them is an `integration` test, whatever its module
# says, so `-m "not integration"` really runs without a server.
_S3_FIXTURES = frozenset(
    {"s3_server", "s3_bucket", "s3_store", "private_s3_server", "private_s3_store", "open_test_node"}
)


# Where each folder of the checkout is installed in the namespace (pyproject.toml's package-dir).
_INSTALLED_AS = {"kvstore": "kvstore", "connector": "kvstore/connector", "admin": "kvstore/admin",
                 "migrations": "kvstore/migrations"}  # fmt: skip


def _unlinked_modules() -> list[str]:
    """Modules of this checkout that the editable install's layout lacks: added since `.ci/bootstrap` linked
    them (see there). Empty where kvstore is imported from this checkout alone (no layout to compare)."""
    import kvstore

    checkout = Path(__file__).resolve().parent.parent
    layouts = [Path(p).parent for p in kvstore.__path__ if Path(p).resolve() != checkout / "kvstore"]
    if not layouts:
        return []
    return sorted(
        str(module.relative_to(checkout))
        for folder, installed in _INSTALLED_AS.items()
        for module in (checkout / folder).rglob("*.py")
        if not (layouts[0] / installed / module.relative_to(checkout / folder)).exists()
    )


def pytest_configure(config: pytest.Config) -> None:
    # The suite's node agents upload at once (`upload_hold_s` has tests of its own): tests wait on uploads
    # with short deadlines while other workers keep the CPUs busy, which would hold the uploads.
    os.environ.setdefault("KVSTORE_UPLOAD_HOLD_S", "0")
    if unlinked := _unlinked_modules():
        raise pytest.UsageError(
            f"{', '.join(unlinked)}: not in the editable install yet (new modules are linked at install "
            "time); run .ci/bootstrap (a new package folder goes into pyproject.toml's packages first)"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _S3_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


def _missing_vllm(report: pytest.CollectReport | pytest.TestReport) -> bool:
    """A skip for want of vLLM (`pytest.importorskip("vllm...")` or a "not installed" reason)."""
    if not report.skipped:
        return False
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    return "vllm" in reason.lower() and ("could not import" in reason or "not installed" in reason)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, pytest.CollectReport]:
    # Where vLLM belongs to the install, a module skipped because vLLM does not import is a failure: with a
    # skip, a broken vLLM install gave a green run.
    report: pytest.CollectReport = yield
    why = vllm_expected()
    if why is not None and _missing_vllm(report):
        report.outcome = "failed"
        report.longrepr = f"vLLM must work here ({why}), but: {report.longrepr}"
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # A run that selects no tests (e.g. `-m vllm` on a machine without vLLM) is not a failure there; where
    # vLLM belongs to the install (`vllm_expected`), it is: the vLLM tests went missing.
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and vllm_expected() is None:
        session.exitstatus = pytest.ExitCode.OK


def open_node_on(server: S3Server, store_url: str, **settings: Any) -> Node:
    """A real node (S3 store on `server`, NVMe cache, engine with metrics of its own); the caller closes it.
    Tests use `open_test_node`; a module's tests that share one node open it here."""
    return open_node(
        load_settings(
            store_url=store_url,
            s3_endpoint=server.endpoint,
            access_key=server.access_key,
            secret_key=server.secret_key,
            **settings,
        ),
        metrics=EngineMetrics(CollectorRegistry()),
    )


@pytest.fixture
def open_test_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """Opens real nodes (S3 store, NVMe cache under `tmp_path/cache` unless given, engine with metrics of its
    own) on an S3 server of the fixtures; every node opened is closed when the test ends."""
    opened: list[Node] = []

    def open_(server: S3Server, store_url: str, **settings: Any) -> Node:
        settings.setdefault("cache_dir", tmp_path / "cache")
        node = open_node_on(server, store_url, **settings)
        opened.append(node)
        return node

    yield open_
    for node in reversed(opened):
        node.close()


@pytest.fixture
def kv_subscriber() -> Iterator[KVEventSubscriber]:
    subscriber = KVEventSubscriber()
    yield subscriber
    subscriber.close()


@pytest.fixture
def connect_kv_subscriber() -> Iterator[Callable[[str], KVEventSubscriber]]:
    """Subscribers that connect to a publisher's endpoint (closed at the end of the test)."""
    made: list[KVEventSubscriber] = []

    def connect(endpoint: str) -> KVEventSubscriber:
        made.append(KVEventSubscriber(connect_to=endpoint))
        return made[-1]

    yield connect
    for subscriber in made:
        subscriber.close()


def _group_stopped(pgid: int) -> bool:
    """Whether every thread of every process in process group ``pgid`` is stopped (state T in /proc), or
    dead: either answers nothing."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            tasks = [(task / "stat").read_text() for task in (proc / "task").iterdir()]
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if any(stat.rsplit(")", 1)[1].split()[0] not in ("T", "t", "Z", "X") for stat in tasks):
            return False
    return True
