"""What the chat benchmarks' miniatures (`test_multiturn`, `test_fleet`) run on: the tiny model with an engine
KV cache and a CPU tier far too small for their conversations, and our tier on the test bucket."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kvstore.connector.bench.multiturn import Sizing
    from kvstore.connector.bench.target import StoreTarget


@pytest.fixture
def small_sizing(tiny_model: Path) -> Sizing:
    from kvstore.connector.bench.multiturn import Sizing, model_kv_bytes_per_token

    return Sizing(
        engine_kv_bytes=4 * 2**20,  # 16 blocks of 128 tokens: about 2.5 conversations
        cpu_bytes=4 * 2**20,
        kv_bytes_per_token=model_kv_bytes_per_token(tiny_model, 2),
        max_model_len=1024,
        max_num_seqs=2,
        max_num_batched_tokens=1024,
    )


@pytest.fixture
def store_target(s3_server: Any, s3_store: Any) -> StoreTarget:
    from kvstore.connector.bench.target import StoreTarget

    return StoreTarget(
        f"s3://{s3_store.bucket}/{s3_store.prefix}",
        s3_server.endpoint,
        {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key},
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
        metrics_url=s3_server.seaweed.metrics_url if s3_server.seaweed is not None else None,
        server_pid=s3_server.seaweed.pid if s3_server.seaweed is not None else None,
    )
