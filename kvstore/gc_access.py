"""GC's side of the access records: merged into last-use times before a run, compacted after it.

Object stores keep no access time, so a chunk's last access is the newest of its `last_modified` and the
timestamps of the access records (`_meta/access/`, written by `kvstore.access`) that name it. A run merges
every record into a dict holding only the chunk keys the records name; afterwards it rewrites the surviving
chunks' times as a few records, new ones first and old ones deleted last, so a crash loses nothing.
"""

from __future__ import annotations

import collections
import math
import time

from kvstore.access import encode_batch, read_access_records
from kvstore.layout import ACCESS_PREFIX
from kvstore.stores import ObjectStore

__all__ = ["COMPACT_BATCH", "compact_records", "merge_access"]

COMPACT_BATCH = 50_000  # keys per compacted access record, like the recorder's default flush size
_COMPACT_ROUND_S = 60.0  # compacted timestamps are rounded *up*: a chunk may look younger, never older
_DELETE_BATCH = 1000  # S3 DeleteObjects takes at most 1000 keys per request


def merge_access(store: ObjectStore) -> tuple[dict[str, float], list[str]]:
    """Newest access timestamp per chunk key named by a record, and the record keys that were read."""
    last: dict[str, float] = {}
    record_keys: list[str] = []
    for record_key, ts, keys in read_access_records(store):
        record_keys.append(record_key)
        for key in keys:
            if ts > last.get(key, 0.0):
                last[key] = ts
    return last, record_keys


def compact_records(store: ObjectStore, live: dict[str, float], record_keys: list[str], run_id: str) -> int:
    """Rewrite the surviving keys' access times as a few records, then delete the records they came from."""
    by_ts: dict[float, list[str]] = collections.defaultdict(list)
    for key, ts in live.items():
        by_ts[math.ceil(ts / _COMPACT_ROUND_S) * _COMPACT_ROUND_S].append(key)
    seq = 0
    for ts, keys in sorted(by_ts.items()):
        hour = time.strftime("%Y%m%d%H", time.gmtime(ts))
        for start in range(0, len(keys), COMPACT_BATCH):
            seq += 1
            name = f"{ACCESS_PREFIX}{hour}/gc-{run_id}-{seq:06d}.json.zst"
            store.put(name, encode_batch(keys[start : start + COMPACT_BATCH], ts))
    for start in range(0, len(record_keys), _DELETE_BATCH):
        store.delete_many(record_keys[start : start + _DELETE_BATCH])
    return len(record_keys)
