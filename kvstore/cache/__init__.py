"""The node-local NVMe cache of chunks: ``NVMeCache`` plus its value types, fsck report and index rebuild."""

from kvstore.cache.fsck import FsckReport, RebuildReport, rebuild_index
from kvstore.cache.lmdb_env import SCHEMA_VERSION
from kvstore.cache.nvme import NVMeCache
from kvstore.cache.records import (
    Backlog,
    CachedChunk,
    CacheUsage,
    Change,
    ChangeKind,
    ReadResult,
    ReadStatus,
    StagedFile,
)

__all__ = [
    "SCHEMA_VERSION",
    "Backlog",
    "CacheUsage",
    "CachedChunk",
    "Change",
    "ChangeKind",
    "FsckReport",
    "NVMeCache",
    "ReadResult",
    "ReadStatus",
    "RebuildReport",
    "StagedFile",
    "rebuild_index",
]
