"""Keys and namespaces: our paths must equal vLLM's FileMapper output byte for byte."""

from __future__ import annotations

import hashlib
import importlib.util

import pytest

from kvstore.errors import ConfigError
from kvstore.keys import (
    KVCacheGroup,
    Namespace,
    chunk_key_to_offload_key,
    make_offload_key,
    split_offload_key,
)

GROUPS = (KVCacheGroup(128, ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")),)

NAMESPACES = [
    Namespace(model_name="tiny/llama", tokens_per_hash=128, dtype="torch.bfloat16", kv_cache_groups=GROUPS),
    Namespace(
        model_name="m", tokens_per_hash=16, dtype="torch.float16", tp_size=4, rank=3, blocks_per_file=2
    ),
    Namespace(
        model_name="org/x", tokens_per_hash=32, dtype="bf16", tp_size=2, rank=1, parallel_agnostic=True
    ),
    Namespace(model_name="y", tokens_per_hash=64, dtype="fp8", replicated_layout=True, canonical_format="c1"),
]


def _keys() -> list[bytes]:
    return [make_offload_key(hashlib.sha256(str(i).encode()).digest(), i % 3) for i in range(20)]


def test_offload_key_round_trip() -> None:
    for key in _keys():
        block_hash, group = split_offload_key(key)
        assert make_offload_key(block_hash, group) == key


def test_chunk_key_layout_and_inverse() -> None:
    ns = NAMESPACES[0]
    key = _keys()[4]
    path = ns.chunk_key(key)
    hash_hex = key[:-4].hex()
    assert path == f"{ns.id}_r0/{hash_hex[:3]}/{hash_hex[3:5]}_g1/{hash_hex}.bin"
    assert ns.id.startswith("tiny_llama_") and len(ns.id) == len("tiny_llama_") + 12
    assert chunk_key_to_offload_key(path) == key
    assert ns.config_key == f"{ns.id}/config.json"


def test_namespace_round_trips_through_config_json() -> None:
    for ns in NAMESPACES:
        rebuilt = Namespace.from_fields(ns.fields(), rank=ns.rank)
        assert rebuilt.id == ns.id
        assert rebuilt.chunk_key(_keys()[0]) == ns.chunk_key(_keys()[0])


def test_bad_namespace_input() -> None:
    with pytest.raises(ConfigError, match="model_name"):
        Namespace(model_name="", tokens_per_hash=16, dtype="bf16")
    with pytest.raises(ConfigError, match="tokens_per_hash"):
        Namespace(model_name="m", tokens_per_hash=0, dtype="bf16")
    with pytest.raises(ConfigError, match="malformed"):
        Namespace.from_fields({"model_name": "m"})
    with pytest.raises(ConfigError, match="not a chunk key"):
        chunk_key_to_offload_key("nope")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.parametrize("ns", NAMESPACES, ids=lambda ns: ns.model_name)
def test_paths_equal_vllm_file_mapper(ns: Namespace) -> None:
    from vllm.v1.kv_offload.file_mapper import FileMapper

    mapper = FileMapper(
        root_dir="root",
        model_name=ns.model_name,
        tokens_per_hash=ns.tokens_per_hash,
        blocks_per_file=ns.blocks_per_file,
        tp_size=2 if ns.parallel_agnostic else ns.tp_size,
        pp_size=ns.pp_size,
        pcp_size=ns.pcp_size,
        dcp_size=ns.dcp_size,
        rank=1 if ns.parallel_agnostic else ns.rank,
        dtype=ns.dtype,
        kv_cache_groups=[g.as_json() for g in ns.kv_cache_groups],
        parallel_agnostic=ns.parallel_agnostic,
        replicated_layout=ns.replicated_layout,
        canonical_format=ns.canonical_format,
    )
    assert mapper.get_run_config() == ns.fields()
    assert mapper.get_config_file_path() == f"root/{ns.config_key}"
    for key in _keys():
        assert mapper.get_file_name(key) == f"root/{ns.chunk_key(key)}"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dtype", "width"),
    [("bfloat16", 2), ("torch.float16", 2), ("float32", 4), ("float8_e4m3fn", 1), ("fp8", 1), ("auto", 1)],
)
def test_element_width_follows_the_dtype(dtype: str, width: int) -> None:
    assert Namespace(model_name="m", tokens_per_hash=16, dtype=dtype).element_width == width
