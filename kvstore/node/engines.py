"""The engines on a cache directory, and the one object store they and their agent serve.

``engines/<pid>`` is one file per engine process using the cache, holding the start time of that process
(a reused pid is not taken for it), its PID namespace and the identity of its store (`store_identity`). An
agent that an engine started exits once none of them is alive and nothing waits for upload. A pid names a
process only in its own namespace: an engine registered from another one (another container without a
shared PID namespace) is taken for alive, and its marker left for that namespace's processes to judge.

A node's engines and its agent must agree on the store: the agent uploads every engine's chunks to *its*
bucket and makes the node's pins follow *its* manifests, so an engine configured for another bucket would
see its chunks land in the wrong one and its pins removed. `register_engine` refuses that engine with a
`StoreMismatch` naming both stores (under an flock, so two engines starting at once cannot both pass), as
does an agent started for a store other than the registered engines' (`check_agreement`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from kvstore.config import Settings
from kvstore.errors import ConfigError
from kvstore.node.agent_files import agent_status
from kvstore.node.private import PRIVATE_FILE, private_dir
from kvstore.processes import alive, pid_namespace, start_time

__all__ = [
    "ENGINES_DIR",
    "StoreMismatch",
    "check_agreement",
    "live_engines",
    "register_engine",
    "store_identity",
    "unregister_engine",
]

ENGINES_DIR = "engines"


class StoreMismatch(ConfigError):
    """Processes on one cache directory configured for different object stores."""


def store_identity(settings: Settings) -> str:
    """What names the object store a process serves: each region's URL and endpoint (never a credential),
    or the embedded server's data directory (its endpoint changes at every start)."""
    stores = settings.stores
    if not stores:
        return f"embedded:{(Path(settings.data_dir) / 's3').absolute()}"
    return " | ".join(
        spec.url.rstrip("/") + (f" at {spec.endpoint.rstrip('/')}" if spec.endpoint else "")
        for spec in stores
    )


def register_engine(cache_dir: str | os.PathLike[str], store: str | None = None) -> Path:
    """Mark this process as an engine using the cache (removed by `unregister_engine`, or found dead).
    With ``store``, refuse (`StoreMismatch`) when a live engine on the cache serves another store."""
    folder = private_dir(Path(cache_dir) / ENGINES_DIR)
    marker = folder / str(os.getpid())
    with _registry_lock(folder):
        if store is not None:
            check_agreement(cache_dir, store, what="this engine")
        record = {"process_start": start_time(os.getpid()), "pid_namespace": pid_namespace(), "store": store}
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
    return marker


def unregister_engine(marker: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        marker.unlink()


def check_agreement(
    cache_dir: str | os.PathLike[str], store: str, *, what: str, with_agent: bool = True
) -> None:
    """`StoreMismatch` if a live engine registered on the cache (or, ``with_agent``, the agent that runs for
    it) serves a store other than ``store``."""
    if with_agent:
        agent = agent_status(cache_dir)
        if agent.store is not None and agent.store != store and agent.pid != os.getpid():
            raise StoreMismatch(
                f"{what} is configured for the object store {store!r}, but the node agent of cache_dir "
                f"{str(cache_dir)!r} (pid {agent.pid}) serves {agent.store!r}: it would upload this engine's "
                "chunks there. Give each store its own cache_dir, or configure them alike."
            )
    for pid, theirs in _engines(Path(cache_dir)):
        if theirs is not None and theirs != store:
            raise StoreMismatch(
                f"{what} is configured for the object store {store!r}, but engine pid {pid} on the same "
                f"cache_dir {str(cache_dir)!r} serves {theirs!r}: the node agent uploads every engine's "
                "chunks to one bucket. Give each store its own cache_dir, or configure them alike."
            )


def live_engines(cache_dir: str | os.PathLike[str]) -> list[int]:
    """Pids of engine processes using the cache; markers of dead ones are removed."""
    return [pid for pid, _ in _engines(Path(cache_dir))]


def _engines(directory: Path) -> Iterator[tuple[int, str | None]]:
    folder = directory / ENGINES_DIR
    try:
        markers = list(folder.iterdir())
    except OSError:
        return
    for marker in markers:
        if not marker.name.isdigit():
            continue
        pid = int(marker.name)
        started, namespace, store = _read_marker(marker)
        if namespace is not None and namespace != pid_namespace():
            yield pid, store  # not ours to judge by its pid
        elif alive(pid) and (started is None or started == start_time(pid)):
            yield pid, store
        else:
            with contextlib.suppress(FileNotFoundError):
                marker.unlink()


def _read_marker(marker: Path) -> tuple[str | None, str | None, str | None]:
    """(process start, PID namespace, store) from a marker; an older release's says less, or nothing."""
    try:
        record = json.loads(marker.read_bytes()[:4096] or b"{}")
    except (OSError, ValueError):
        return None, None, None
    if not isinstance(record, dict):
        return None, None, None
    fields = (record.get("process_start"), record.get("pid_namespace"), record.get("store"))
    started, namespace, store = (value if isinstance(value, str) else None for value in fields)
    return started, namespace, store


@contextlib.contextmanager
def _registry_lock(folder: Path) -> Iterator[None]:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
