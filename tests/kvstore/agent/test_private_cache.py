"""The cache is its owner's alone: under umask 022 another local user once read chunks and the index's keys,
and by holding an flock on a 0644 `agent.lock` kept every agent out. Every directory 0700, every file 0600
(the agent's lock, status, socket and log, the index, chunk files, the engines' markers), and a cache an
older release made is tightened when it is opened."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.config import Settings, load_settings
from kvstore.node.agent_files import agent_status
from kvstore.runtime import Node
from kvstore.storage import open_cache
from tests.engine_helpers import keys, payload
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def loose_umask() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    found = {".": stat.S_IMODE(root.stat().st_mode)}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            found[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return found


def test_the_cache_is_its_owners_alone_whatever_the_umask(
    settings: Settings, open_engine_node: Callable[..., Node], loose_umask: None
) -> None:
    node = open_engine_node("spawn")
    names = keys(4, "private")
    assert node.engine.store_many([(k, payload(i)) for i, k in enumerate(names)]).written == 4
    wait_for(lambda: all(node.store.exists_many(names)), timeout=60, what="the agent at work")
    wait_for(lambda: agent_status(settings.cache_dir).store is not None, what="its status file")
    root = Path(settings.cache_dir)
    modes = _modes(root)
    for name in ("agent.lock", "agent.json", "agent.sock", "agent.log", "index/data.mdb", "index/lock.mdb"):
        assert name in modes, name
    assert any(name.startswith("engines/") for name in modes)
    assert sum(name.startswith("chunks/") and name.count("/") == 2 for name in modes) == 4
    loose = {
        name: oct(mode)
        for name, mode in modes.items()
        if mode != (0o700 if (root / name).is_dir() and not (root / name).is_symlink() else 0o600)
    }
    assert loose == {}


def test_a_loose_cache_is_tightened_when_it_is_opened(tmp_path: Path) -> None:
    settings = load_settings(
        store_url=(tmp_path / "store").as_uri(), cache_dir=str(tmp_path / "nvme"), cache_bytes=1 << 30
    )
    cache = open_cache(settings)
    cache.close()
    root = Path(settings.cache_dir)
    (root / "chunks" / "ab").mkdir()
    for name in ("agent.lock", "agent.json", "agent.log"):
        (root / name).write_text("")
    for folder, dirs, files in os.walk(root):  # as an older release under umask 022 left it
        for name in dirs:
            os.chmod(Path(folder) / name, 0o755)
        for name in files:
            os.chmod(Path(folder) / name, 0o644)
    os.chmod(root, 0o755)
    open_cache(settings).close()
    modes = _modes(root)
    loose = {
        name: oct(mode)
        for name, mode in modes.items()
        if mode != (0o700 if (root / name).is_dir() else 0o600)
    }
    assert loose == {}
