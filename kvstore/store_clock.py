"""The object store's clock: what time the store says it is.

Whatever judges an age against a store's `last_modified` (GC's TTL and grace period, the timestamps access
records carry) must read "now" off the same clock, never its own host's: a host whose clock runs an hour
ahead would otherwise see every chunk uploaded seconds ago as an hour old, and one an hour behind would
stamp a use seconds ago as an hour old. The store tells its time through the `last_modified` it gives an
object just written (`store_now`).
"""

from __future__ import annotations

import time

from kvstore.errors import StoreUnavailable
from kvstore.layout import GC_CLOCK_PREFIX
from kvstore.stores import ObjectStore

__all__ = ["LISTING_RESOLUTION_S", "store_now"]

# S3 listings give `last_modified` in whole seconds, truncated.
LISTING_RESOLUTION_S = 1.0


def store_now(store: ObjectStore, marker: str) -> float:
    """The store's clock now: the `last_modified` it gives a marker this call writes (and then deletes), named
    `marker` (unique per caller). Listings truncate it to whole seconds, so it is never ahead of the store's
    time: ages come out a little short, which keeps chunks rather than deleting them."""
    key = f"{GC_CLOCK_PREFIX}{marker}"
    store.put(key, b"")
    try:
        for _ in range(3):  # a store whose listings lag its writes lists it on a later try
            listed = [info.last_modified for info in store.list(key) if info.key == key]
            if listed:
                return listed[0]
            time.sleep(0.1)
        raise StoreUnavailable(f"the store does not list {key} it just wrote: cannot read its clock")
    finally:
        store.delete(key)
