"""The `kv_transfer_config` that runs vLLM's tiering stack on the CPU backend, with given secondary tiers."""

from __future__ import annotations

from typing import Any

CPU_BLOCK_TOKENS = 128  # vLLM's KV block on its CPU backend: one chunk unless `chunk_tokens` says more


def cpu_tiering_config(
    *secondary_tiers: dict[str, Any], cpu_bytes: int = 64 * 2**20, chunk_tokens: int = 0
) -> dict[str, Any]:
    """OffloadingConnector + CPUTieringSpec: a CPU primary tier of `cpu_bytes`, then `secondary_tiers`.
    `chunk_tokens`: tokens per offloaded chunk, a multiple of the KV block (vLLM's `block_size` in the extra
    config; every tier stores and loads whole chunks, and ours makes each one object). 0: one KV block, vLLM's
    default (128 tokens on its CPU backend)."""
    extra: dict[str, Any] = {
        "spec_name": "CPUTieringSpec",
        "spec_module_path": "kvstore.connector.cpu",
        "cpu_bytes_to_use": cpu_bytes,
        "secondary_tiers": list(secondary_tiers),
    }
    if chunk_tokens:
        extra["block_size"] = chunk_tokens
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
