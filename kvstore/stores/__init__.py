"""Object stores: one small contract (`ObjectStore`) and its backends, opened directly or from a URL;
`RegionalStore` puts read-only remote regions behind the local one."""

from kvstore.stores.base import Data, ObjectInfo, ObjectStore
from kvstore.stores.local import LocalStore
from kvstore.stores.memory import MemoryStore
from kvstore.stores.regions import RegionalStore, get_each_located, get_located
from kvstore.stores.s3 import S3Options, S3Store
from kvstore.stores.url import open_store

__all__ = [
    "Data",
    "LocalStore",
    "MemoryStore",
    "ObjectInfo",
    "ObjectStore",
    "RegionalStore",
    "S3Options",
    "S3Store",
    "get_each_located",
    "get_located",
    "open_store",
]
