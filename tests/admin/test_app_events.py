"""The admin service's GC events describe bucket copies exactly as the tiers' events do."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import pytest

from kvstore.admin.app import create_app
from kvstore.events import OWNERSHIP_OBJECT
from kvstore.keys import Namespace, make_offload_key
from kvstore.runtime import Node

pytestmark = pytest.mark.integration

NS = Namespace(model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16")


@pytest.mark.parametrize("locality", ["REMOTE", "LOCAL"])
def test_gc_events_carry_the_configured_object_locality(
    locality: str, s3_server: Any, s3_store: Any, open_test_node: Callable[..., Node], kv_subscriber: Any
) -> None:
    node = open_test_node(
        s3_server,
        f"s3://{s3_store.bucket}/{s3_store.prefix}",
        events_endpoint=kv_subscriber.endpoint,
        object_locality=locality,
    )
    app = create_app(node)
    key = NS.chunk_key(make_offload_key(hashlib.sha256(b"gc'd").digest(), 0))
    app.state.gc_on_removed([key])  # what a GC job calls for each deleted batch
    _, _, batch = kv_subscriber.next()
    [event] = batch.events
    assert (event.medium, event.locality, event.ownership) == ("STORAGE", locality, OWNERSHIP_OBJECT)
    app.state.events.close()
