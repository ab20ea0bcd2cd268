"""Namespaces and chunk keys, laid out exactly like vLLM's `FileMapper` (no vllm import needed).

A chunk's object key (relative to the store's prefix) is::

    <model>_<sha12>_r<rank>/<hhh>/<hh>_g<group>/<hash hex>.bin

where `<model>_<sha12>` is the namespace id: the model name with '/' replaced by '_' and the first 12 hex
digits of sha256 over the canonical JSON of every field that makes KV bytes non-interchangeable. Each
namespace stores that JSON as `<model>_<sha12>/config.json`. Two instances with the same configuration
therefore compute the same keys, and share chunks with no extra setup.

An offload key is vLLM's `OffloadKey`: the chained block hash followed by a 4-byte big-endian group index.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import ConfigError
from kvstore.layout import CONFIG_FILENAME

_NAMESPACE_HASH_LEN = 12


def make_offload_key(block_hash: bytes, group: int = 0) -> bytes:
    """vLLM's OffloadKey: block hash + 4-byte big-endian KV-cache group index."""
    return block_hash + group.to_bytes(4, "big", signed=False)


def split_offload_key(key: bytes) -> tuple[bytes, int]:
    return key[:-4], int.from_bytes(key[-4:], "big", signed=False)


@dataclass(frozen=True)
class KVCacheGroup:
    tokens_per_block: int
    layer_names: tuple[str, ...]

    def as_json(self) -> dict[str, Any]:
        return {"tokens_per_block": self.tokens_per_block, "layer_names": list(self.layer_names)}


@dataclass(frozen=True)
class Namespace:
    """Everything that makes KV bytes non-interchangeable; mirrors the fields vLLM's FileMapper hashes."""

    model_name: str
    tokens_per_hash: int
    dtype: str
    kv_cache_groups: tuple[KVCacheGroup, ...] = ()
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    rank: int = 0
    blocks_per_file: int = 1
    inference_engine: str = "vllm"
    parallel_agnostic: bool = False
    replicated_layout: bool = False
    canonical_format: str | None = None
    _id: str = field(init=False, repr=False, compare=False)

    @property
    def element_width(self) -> int:
        """Bytes per KV element of `dtype` ("bfloat16" 2, "float32" 4, fp8 and int8 1): the byte-shuffle width
        of the zstd codec. 1 (no shuffle, still correct) for a dtype that names no bit width."""
        bits = re.search(r"\d+", self.dtype)  # the first number: "float8_e4m3fn" is 8 bits
        return max(1, int(bits.group()) // 8) if bits else 1

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ConfigError("namespace: model_name must not be empty")
        if self.tokens_per_hash <= 0:
            raise ConfigError(f"namespace: tokens_per_hash must be positive, got {self.tokens_per_hash}")
        if self.parallel_agnostic:
            # One folder for every parallel layout, as FileMapper does.
            for name in ("tp_size", "pp_size", "pcp_size", "dcp_size"):
                object.__setattr__(self, name, 1)
            object.__setattr__(self, "rank", 0)
        digest = hashlib.sha256(self.canonical_json().encode()).hexdigest()[:_NAMESPACE_HASH_LEN]
        object.__setattr__(self, "_id", f"{self.model_name.replace('/', '_')}_{digest}")

    def fields(self) -> dict[str, Any]:
        """The hashed fields, in FileMapper's exact shape (optional ones only when they differ)."""
        out: dict[str, Any] = {
            "model_name": self.model_name,
            "tokens_per_hash": self.tokens_per_hash,
            "blocks_per_file": self.blocks_per_file,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "pcp_size": self.pcp_size,
            "dcp_size": self.dcp_size,
            "dtype": str(self.dtype),
            "kv_cache_groups": [g.as_json() for g in self.kv_cache_groups],
            "inference_engine": self.inference_engine,
        }
        if not self.parallel_agnostic:
            out["parallel_agnostic"] = False
        if self.replicated_layout:
            out["replicated_layout"] = True
        if self.canonical_format is not None:
            out["canonical_format"] = self.canonical_format
        return out

    def canonical_json(self) -> str:
        return json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))

    @property
    def id(self) -> str:
        """`<model>_<sha12>`: the namespace folder, shared by every rank."""
        return self._id

    @property
    def config_key(self) -> str:
        return f"{self._id}/{CONFIG_FILENAME}"

    def chunk_key(self, offload_key: bytes) -> str:
        """The object key of one chunk; hot path, so no validation beyond slicing."""
        hash_hex = offload_key[:-4].hex()
        group = int.from_bytes(offload_key[-4:], "big")
        return f"{self._id}_r{self.rank}/{hash_hex[:3]}/{hash_hex[3:5]}_g{group}/{hash_hex}.bin"

    @classmethod
    def from_fields(cls, fields: dict[str, Any], rank: int = 0) -> Namespace:
        """Rebuild a namespace from a stored `config.json` (rank lives outside the hash)."""
        try:
            groups = tuple(
                KVCacheGroup(int(g["tokens_per_block"]), tuple(g["layer_names"]))
                for g in fields.get("kv_cache_groups", [])
            )
            return cls(
                model_name=str(fields["model_name"]),
                tokens_per_hash=int(fields["tokens_per_hash"]),
                dtype=str(fields["dtype"]),
                kv_cache_groups=groups,
                tp_size=int(fields.get("tp_size", 1)),
                pp_size=int(fields.get("pp_size", 1)),
                pcp_size=int(fields.get("pcp_size", 1)),
                dcp_size=int(fields.get("dcp_size", 1)),
                rank=rank,
                blocks_per_file=int(fields.get("blocks_per_file", 1)),
                inference_engine=str(fields.get("inference_engine", "vllm")),
                parallel_agnostic="parallel_agnostic" not in fields,  # FileMapper omits it when True
                replicated_layout=bool(fields.get("replicated_layout", False)),
                canonical_format=fields.get("canonical_format"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"namespace config is malformed: {exc}") from None


def chunk_key_to_offload_key(chunk_key: str) -> bytes:
    """Inverse of `Namespace.chunk_key` for the hash and group (used by GC and events)."""
    try:
        _, _, group_dir, name = chunk_key.rsplit("/", 3)
        group = int(group_dir.split("_g", 1)[1])
        return make_offload_key(bytes.fromhex(name.removesuffix(".bin")), group)
    except (ValueError, IndexError):
        raise ConfigError(f"not a chunk key: {chunk_key!r}") from None
