"""The `kv_transfer_config` that runs vLLM's tiering stack on the CPU backend, with given secondary tiers."""

from __future__ import annotations

from typing import Any


def cpu_tiering_config(*secondary_tiers: dict[str, Any], cpu_bytes: int = 64 * 2**20) -> dict[str, Any]:
    """OffloadingConnector + CPUTieringSpec: a CPU primary tier of `cpu_bytes`, then `secondary_tiers`."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "CPUTieringSpec",
            "spec_module_path": "kvstore.connector.cpu",
            "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": list(secondary_tiers),
        },
    }
