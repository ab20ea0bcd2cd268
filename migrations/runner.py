"""Apply the numbered migrations to a node's cache index and/or a bucket: `migrate(cache_dir=, store=)`.

Two targets, each with its own version: the LMDB index (`schema_version` in its `meta` database, 0 when
absent) and the bucket (`_meta/layout.json` `{"version": N}`, 0 when absent). Every step whose `VERSION`
exceeds a target's version runs against that target, in order; each step records its own version, so an
interrupted run resumes where it stopped and a second run applies nothing. A target newer than this code
knows is refused: old code must not rewrite data it does not understand.

Run it before the node's processes open the cache (`kvstore migrate`): LMDB allows one environment handle per
process, so migrating an index this process already has open is refused.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

import lmdb

from kvstore.cache import index_flush
from kvstore.cache import lmdb_env as cache_index
from kvstore.errors import KVStoreError
from kvstore.layout import LAYOUT_KEY
from kvstore.stores.base import ObjectStore

__all__ = [
    "LATEST_VERSION",
    "MIGRATIONS",
    "Applied",
    "MigrationContext",
    "MigrationError",
    "Step",
    "load_steps",
    "migrate",
]

# The code's schema version; the steps must reach exactly this (checked in `load_steps`).
LATEST_VERSION = cache_index.SCHEMA_VERSION
MIGRATIONS = "kvstore.migrations"


class MigrationError(KVStoreError):
    """A target cannot be migrated: newer than this code, malformed, or open in this process."""


@dataclass(frozen=True)
class MigrationContext:
    """What one step works on; a target is `None` when it is already at or past the step's version."""

    env: lmdb.Environment | None = None
    store: ObjectStore | None = None
    cache_dir: Path | None = None  # with `env`: the cache directory whose index it is


@dataclass(frozen=True)
class Step:
    version: int
    describe: str
    apply: Callable[[MigrationContext], None]
    module: str


@dataclass(frozen=True)
class Applied:
    """One step run against one target."""

    target: Literal["cache", "bucket"]
    version: int
    describe: str


def _as_step(module: ModuleType) -> Step:
    try:
        return Step(int(module.VERSION), str(module.describe), module.apply, module.__name__)
    except AttributeError as exc:
        raise MigrationError(f"migration {module.__name__} lacks VERSION, describe or apply: {exc}") from None


def load_steps() -> list[Step]:
    """Every `mNNNN_*` module of this package by version; versions must run 1..LATEST without gaps."""
    package = importlib.import_module(MIGRATIONS)
    names = sorted(
        m.name for m in pkgutil.iter_modules(package.__path__) if m.name[:1] == "m" and m.name[1:5].isdigit()
    )
    steps = sorted(
        (_as_step(importlib.import_module(f"{MIGRATIONS}.{n}")) for n in names), key=lambda s: s.version
    )
    if [s.version for s in steps] != list(range(1, LATEST_VERSION + 1)):
        raise MigrationError(
            f"migration versions {[s.version for s in steps]} do not run 1..{LATEST_VERSION}"
        )
    return steps


def migrate(
    cache_dir: str | os.PathLike[str] | None = None, store: ObjectStore | None = None
) -> list[Applied]:
    """Bring the cache index under `cache_dir` and/or the bucket behind `store` to `LATEST_VERSION`."""
    steps = load_steps()
    applied: list[Applied] = []
    if cache_dir is not None:
        applied += _migrate_cache(Path(cache_dir), steps)
    if store is not None:
        applied += _migrate_bucket(store, steps)
    return applied


def _migrate_cache(cache_dir: Path, steps: list[Step]) -> list[Applied]:
    path = cache_dir / cache_index.INDEX_DIR
    if not (path / "data.mdb").exists():
        return []  # no index yet: the cache creates it at the current version
    if cache_index.is_open_in_this_process(cache_dir):
        return []  # open here already, so current: an index older than the code is refused at open
    if index_flush.suspect(str(path)):
        return []  # suspect after a machine crash: never read, rebuilt at the current version at open
    try:
        cache_index.check_data_file(str(path))
    except KVStoreError as exc:
        raise MigrationError(str(exc)) from None
    try:
        env = lmdb.open(str(path), max_dbs=8, map_size=cache_index.DEFAULT_MAP_SIZE, subdir=True)
    except lmdb.Error as exc:
        raise MigrationError(f"cannot open cache index {str(path)!r}: {exc}") from exc
    try:
        applied: list[Applied] = []
        for step in steps:
            version = _index_version(env)
            if version > LATEST_VERSION:
                raise MigrationError(
                    f"cache index {str(path)!r} has schema version {version}, "
                    f"newer than this kvstore supports "
                    f"({LATEST_VERSION}); upgrade kvstore"
                )
            if version >= step.version:
                continue
            step.apply(MigrationContext(env=env, cache_dir=cache_dir))
            if _index_version(env) < step.version:
                raise MigrationError(f"{step.module} did not stamp schema version {step.version}")
            applied.append(Applied("cache", step.version, step.describe))
        if _index_version(env) > LATEST_VERSION:
            raise MigrationError(
                f"cache index {str(path)!r} is newer than this kvstore supports ({LATEST_VERSION})"
            )
        return applied
    finally:
        env.close()


def _index_version(env: lmdb.Environment) -> int:
    return cache_index.read_schema_version(env)


def _bucket_version(store: ObjectStore) -> int:
    raw = store.get(LAYOUT_KEY)
    if raw is None:
        return 0
    try:
        version = json.loads(raw)["version"]
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"bad version {version!r}")
        return version
    except (ValueError, KeyError, TypeError) as exc:
        raise MigrationError(f"{LAYOUT_KEY} in {store.url} is malformed: {exc}") from None


def _migrate_bucket(store: ObjectStore, steps: list[Step]) -> list[Applied]:
    applied: list[Applied] = []
    for step in steps:
        version = _bucket_version(store)
        if version > LATEST_VERSION:
            raise MigrationError(
                f"bucket {store.url} has layout version {version}, newer than this kvstore supports "
                f"({LATEST_VERSION}); upgrade kvstore"
            )
        if version >= step.version:
            continue
        step.apply(MigrationContext(store=store))
        applied.append(Applied("bucket", step.version, step.describe))
    if _bucket_version(store) > LATEST_VERSION:
        raise MigrationError(f"bucket {store.url} is newer than this kvstore supports ({LATEST_VERSION})")
    return applied
