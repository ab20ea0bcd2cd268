from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cache import NVMeCache
from kvstore.chunk import stored_size

# The helpers in cache_workers.py also run in spawned and subprocess children, which import them by module
# name; put this folder on sys.path (children inherit it) whatever pytest's import mode is.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "nvme"


@pytest.fixture
def cache(cache_dir: Path) -> Iterator[NVMeCache]:
    with NVMeCache(cache_dir, 10 * stored_size(100)) as c:
        yield c
