"""The engines registered on a cache directory: a marker whose process is gone is removed, unless the pid
was taken in another PID namespace, where this process cannot tell."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvstore.node.engines import ENGINES_DIR, live_engines, register_engine, unregister_engine
from kvstore.processes import alive, pid_namespace


def _dead_pid() -> int:
    pid = 4_000_000
    while alive(pid):
        pid -= 1
    return pid


def _marker(cache_dir: Path, pid: int, **record: str) -> Path:
    folder = cache_dir / ENGINES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / str(pid)
    path.write_text(json.dumps({"process_start": "1", "store": "s3://b", **record}))
    return path


def test_an_engine_of_another_pid_namespace_is_left_alone(tmp_path: Path) -> None:
    """A node agent in one container and an engine in another, each with its own PID namespace: the
    engine's pid means nothing here, so its marker stays (before: it was taken for dead and removed, and an
    agent started for engines exited while that engine still served)."""
    assert pid_namespace() is not None
    dead = _dead_pid()
    elsewhere = _marker(tmp_path, dead, pid_namespace="pid:[1]")
    assert live_engines(tmp_path) == [dead]
    assert elsewhere.exists()


def test_a_dead_engine_of_this_namespace_or_an_older_release_is_removed(tmp_path: Path) -> None:
    dead = _dead_pid()
    here = _marker(tmp_path, dead, pid_namespace=pid_namespace() or "")
    older = _marker(tmp_path, _dead_pid() - 1)  # an older release's marker: no namespace
    mine = register_engine(tmp_path, "s3://b")
    assert live_engines(tmp_path) == [os.getpid()]
    assert not here.exists() and not older.exists()
    assert json.loads(mine.read_text())["pid_namespace"] == pid_namespace()
    unregister_engine(mine)
    assert live_engines(tmp_path) == []
