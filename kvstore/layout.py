"""The bucket's layout: every name kvstore writes under a store's prefix, declared here and nowhere else.

```
<prefix>/
  <model>_<sha12>/config.json                          a namespace's hashed fields (CONFIG_FILENAME)
  <model>_<sha12>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin  a chunk: vLLM FileMapper's name, format in chunk.py
  _meta/                                               everything that is not KV (META_PREFIX)
    layout.json                                        {"version": N}, the migrations' bucket version
    pins/<name>.json                                   pin manifests (kvstore.pins)
    pin-deletes/<name>/<sha>                           who deletes which version of a manifest (kvstore.pins)
    access/<YYYYMMDDHH>/<node>-<pid>-<seq>.json.zst    which chunks a node used, and when (kvstore.access)
    leases/<name>.json                                 leases, e.g. the one GC holds (kvstore.lease)
    gc/reports/<time>-<token>.json                     a report per GC run (kvstore.gc)
    gc/clock/<run id>                                  GC reads the store's clock off it, then deletes it
    gc/deleting.json                                   GC's marker during a delete batch (kvstore.pin_fence)
    gc/holds/<id>.json                                 a pin creator's hold on deletes (kvstore.pin_fence)
```

A `.bin` object outside `_meta/` is a chunk (`is_chunk_key`): what GC may delete, what remote regions are
asked for. Anything else under the prefix is left alone.
"""

from __future__ import annotations

__all__ = [
    "ACCESS_PREFIX",
    "CONFIG_FILENAME",
    "GC_CLOCK_PREFIX",
    "GC_HOLD_PREFIX",
    "GC_MARKER_KEY",
    "GC_REPORT_PREFIX",
    "LAYOUT_KEY",
    "LEASE_PREFIX",
    "META_PREFIX",
    "PIN_DELETE_PREFIX",
    "PIN_PREFIX",
    "is_chunk_key",
]

CONFIG_FILENAME = "config.json"
META_PREFIX = "_meta/"
LAYOUT_KEY = META_PREFIX + "layout.json"
PIN_PREFIX = META_PREFIX + "pins/"
PIN_DELETE_PREFIX = META_PREFIX + "pin-deletes/"
ACCESS_PREFIX = META_PREFIX + "access/"
LEASE_PREFIX = META_PREFIX + "leases/"
GC_REPORT_PREFIX = META_PREFIX + "gc/reports/"
GC_CLOCK_PREFIX = META_PREFIX + "gc/clock/"
GC_MARKER_KEY = META_PREFIX + "gc/deleting.json"
GC_HOLD_PREFIX = META_PREFIX + "gc/holds/"


def is_chunk_key(key: str) -> bool:
    """Whether `key` names a chunk object (a `.bin` object outside `_meta/`)."""
    return key.endswith(".bin") and not key.startswith(META_PREFIX)
