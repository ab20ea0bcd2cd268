"""The node-local NVMe cache of chunk blobs: ``NVMeCache`` plus its value types and fsck report."""

from kvstore.cache.fsck import FsckReport
from kvstore.cache.index import SCHEMA_VERSION
from kvstore.cache.nvme import CachedChunk, CacheUsage, NVMeCache

__all__ = ["SCHEMA_VERSION", "CacheUsage", "CachedChunk", "FsckReport", "NVMeCache"]
