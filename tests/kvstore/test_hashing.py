"""`kvstore.hashing` against vLLM's own prefix hashing and the offloading connector's chunk naming."""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvstore.errors import ConfigError
from kvstore.hashing import block_hashes, chunk_keys, chunk_refs, none_hash
from kvstore.keys import KVCacheGroup, Namespace

kv_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
vllm_hashing = pytest.importorskip("vllm.utils.hashing")


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 128_000) for _ in range(n)]


@pytest.fixture(params=[None, "0", "1234"], ids=["seed-unset", "seed-0", "seed-1234"])
def hash_seed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str | None]:
    """Set or clear PYTHONHASHSEED, then re-derive vLLM's NONE_HASH the way the engine does at start-up."""
    value: str | None = request.param
    if value is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", value)
    yield value
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_utils.init_none_hash(vllm_hashing.sha256)


def _vllm_block_hashes(tokens: list[int], block_size: int, algo: str) -> list[bytes]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    fn = vllm_hashing.get_hash_fn_by_name(algo)
    kv_utils.init_none_hash(fn)
    req = Request(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=kv_utils.get_request_block_hasher(block_size, fn),
    )
    return [bytes(h) for h in req.block_hashes]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize(("block_size", "n_tokens"), [(16, 100), (128, 1000), (64, 64), (128, 127)])
def test_block_hashes_equal_vllm(hash_seed: str | None, algo: str, block_size: int, n_tokens: int) -> None:
    tokens = _tokens(n_tokens, seed=block_size)
    expected = _vllm_block_hashes(tokens, block_size, algo)
    assert len(expected) == n_tokens // block_size
    assert block_hashes(tokens, block_size, algo=algo) == expected
    assert none_hash(algo) == bytes(kv_utils.NONE_HASH)


def test_seed_changes_every_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = _tokens(256)
    default = block_hashes(tokens, 128)
    assert block_hashes(tokens, 128, seed="vllm-none-hash") == default
    seeded = block_hashes(tokens, 128, seed="7")
    assert not set(default) & set(seeded)


def _vllm_offload_keys(
    hashes: list[bytes], groups: list[tuple[int, int]], tokens_per_hash: int
) -> list[bytes]:
    """Drive the connector's own `RequestOffloadState.update_offload_keys` with stand-in state objects."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import RequestOffloadState

    configs = [
        SimpleNamespace(group_idx=g, tokens_per_chunk=tpc, hashes_per_chunk=tpc // tokens_per_hash)
        for g, tpc in groups
    ]
    states = [SimpleNamespace(offload_keys=[]) for _ in groups]
    positions: dict[bytes, int] = {}
    fake: Any = SimpleNamespace(
        config=SimpleNamespace(kv_group_configs=configs),
        group_states=states,
        req=SimpleNamespace(block_hashes=[kv_utils.BlockHash(h) for h in hashes]),
        req_context=SimpleNamespace(set_offload_key_position=positions.__setitem__),
    )
    RequestOffloadState.update_offload_keys(fake)
    return [bytes(k) for s in states for k in s.offload_keys]


@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 4])
def test_chunk_keys_follow_the_offloading_connector(blocks_per_chunk: int) -> None:
    ns = Namespace(
        model_name="org/tiny",
        tokens_per_hash=128,
        dtype="bfloat16",
        kv_cache_groups=(KVCacheGroup(128, ("l0", "l1")), KVCacheGroup(256, ("l2",))),
    )
    tokens = _tokens(128 * 9 + 5)
    refs = chunk_refs(ns, tokens, blocks_per_chunk=blocks_per_chunk)
    hashes = block_hashes(tokens, 128)
    groups = [(0, 128 * blocks_per_chunk), (1, 256 * blocks_per_chunk)]
    assert [r.offload_key for r in refs] == _vllm_offload_keys(hashes, groups, 128)
    assert [r.key for r in refs] == chunk_keys(ns, tokens, blocks_per_chunk=blocks_per_chunk)
    assert all(r.key == ns.chunk_key(r.offload_key) for r in refs)
    g0 = [r for r in refs if r.group == 0]
    assert [r.end_token for r in g0] == [128 * blocks_per_chunk * (i + 1) for i in range(len(g0))]
    assert refs[0].key.startswith(f"{ns.id}_r0/") and refs[0].key.endswith(
        "_g0/" + hashes[blocks_per_chunk - 1].hex() + ".bin"
    )


def test_namespace_without_groups_uses_hash_granularity() -> None:
    ns = Namespace(model_name="m", tokens_per_hash=16, dtype="float16")
    assert len(chunk_keys(ns, _tokens(50))) == 3


def test_rejects_unpredictable_or_bad_settings() -> None:
    with pytest.raises(ConfigError, match="xxhash"):
        block_hashes([1, 2], 1, algo="xxhash")
    with pytest.raises(ConfigError):
        block_hashes([1, 2], 0)
    ns = Namespace(
        model_name="m", tokens_per_hash=128, dtype="f", kv_cache_groups=(KVCacheGroup(96, ("a",)),)
    )
    with pytest.raises(ConfigError, match="multiple"):
        chunk_keys(ns, _tokens(300))
