"""`/v1/pins` and this node's own cache: a pin created or deleted through the service is applied to the
node's NVMe cache at once, not only at the next pin sync (which is off here)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from kvstore.admin.app import create_app
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.runtime import Node

NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)


def test_create_pins_and_delete_unpins_on_this_node(
    s3_server: Any, s3_bucket: str, open_test_node: Callable[..., Node]
) -> None:
    node = open_test_node(s3_server, f"s3://{s3_bucket}", cache_bytes=10 << 20, pin_sync_s=0)
    node.store.put(NS.config_key, json.dumps(NS.fields()).encode())
    client = TestClient(create_app(node))
    created = client.post("/v1/pins", json={"name": "sys", "namespace": NS.id, "token_ids": list(range(48))})
    assert created.status_code == 201, created.text
    keys = created.json()["keys"]
    assert len(keys) == 3 and [node.cache.pinned(k) for k in keys] == [1, 1, 1]
    assert client.delete("/v1/pins/sys").status_code == 204
    assert [node.cache.pinned(k) for k in keys] == [0, 0, 0], "the deleted pin still holds this node's cache"
