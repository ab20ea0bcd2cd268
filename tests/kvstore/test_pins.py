"""Pin manifests in a real S3 bucket, node sync with a real NVMe cache, and token inputs vs transformers."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.cache.nvme import NVMeCache
from kvstore.errors import ConfigError
from kvstore.hashing import block_hashes
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.pins import (
    NamespaceNotFound,
    PinExists,
    PinNotFound,
    PinSyncLoop,
    apply_pins,
    create_pin,
    delete_pin,
    get_pin,
    keys_for_tokens,
    list_pins,
    load_namespace,
    pinned_keys,
    tokens_from_messages,
    tokens_from_prompt,
    validate_pin_name,
)
from kvstore.stores.base import ObjectStore

NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)


def _keys(n_tokens: int, start: int = 0) -> list[str]:
    return keys_for_tokens(NS, list(range(start, start + n_tokens)))


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[NVMeCache]:
    with NVMeCache(tmp_path / "nvme", 1 << 20) as c:
        yield c


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvstore.connector.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_manifest_round_trip(s3_store: ObjectStore) -> None:
    keys = _keys(64)
    assert len(keys) == 4
    made = create_pin(s3_store, "sys-prompt.v1", NS, keys + keys[:1])
    assert made.keys == tuple(keys) and made.expires_at is None and made.namespace == NS.id
    raw = json.loads(s3_store.get("_meta/pins/sys-prompt.v1.json") or b"")
    assert set(raw) == {"name", "namespace", "namespace_fields", "keys", "created_at", "expires_at"}
    assert Namespace.from_fields(raw["namespace_fields"]).id == NS.id
    assert get_pin(s3_store, "sys-prompt.v1") == made
    assert [p.name for p in list_pins(s3_store)] == ["sys-prompt.v1"]
    with pytest.raises(PinExists):
        create_pin(s3_store, "sys-prompt.v1", NS, keys)
    delete_pin(s3_store, "sys-prompt.v1")
    with pytest.raises(PinNotFound):
        get_pin(s3_store, "sys-prompt.v1")
    with pytest.raises(PinNotFound):
        delete_pin(s3_store, "sys-prompt.v1")


def test_expiry_and_pinned_keys(s3_store: ObjectStore) -> None:
    create_pin(s3_store, "forever", NS, _keys(32))
    short = create_pin(s3_store, "short", NS, _keys(32, start=1000), ttl_seconds=0.5)
    assert short.expires_at is not None
    assert pinned_keys(s3_store) == set(_keys(32)) | set(_keys(32, start=1000))
    time.sleep(0.6)
    assert pinned_keys(s3_store) == set(_keys(32))
    assert [p.name for p in list_pins(s3_store, include_expired=False)] == ["forever"]
    # An expired pin's name can be reused.
    assert create_pin(s3_store, "short", NS, _keys(16)).expires_at is None


def test_validation(s3_store: ObjectStore) -> None:
    for bad in ["", ".", "..", "a/b", "x" * 129, "sp ace", "é"]:
        with pytest.raises(ConfigError):
            validate_pin_name(bad)
    other = Namespace(model_name="other", tokens_per_hash=16, dtype="bfloat16")
    with pytest.raises(ConfigError, match="do not belong"):
        create_pin(s3_store, "p", other, _keys(16))
    with pytest.raises(ConfigError):
        create_pin(s3_store, "p", NS, _keys(16), ttl_seconds=0)
    s3_store.put("_meta/pins/broken.json", b"{not json")
    assert list_pins(s3_store) == []  # a bad manifest is skipped, not fatal


def test_apply_pins_syncs_node(s3_store: ObjectStore, cache: NVMeCache) -> None:
    a, b = _keys(32), _keys(32, start=500)
    create_pin(s3_store, "a", NS, a)
    create_pin(s3_store, "b", NS, b + a[:1])  # overlapping key: pinned once by the sync
    cache.pin([b[0]])  # someone else's pin must survive our unpin
    sync = apply_pins(cache, s3_store)
    assert (sync.pinned, sync.unpinned, sync.total) == (4, 0, 4)
    assert [cache.pinned(k) for k in a] == [1, 1]
    assert [cache.pinned(k) for k in b] == [2, 1]
    again = apply_pins(cache, s3_store)
    assert (again.pinned, again.unpinned) == (0, 0)
    delete_pin(s3_store, "b")
    sync = apply_pins(cache, s3_store)
    assert (sync.pinned, sync.unpinned) == (0, 2)
    assert [cache.pinned(k) for k in b] == [1, 0]
    assert [cache.pinned(k) for k in a] == [1, 1]
    # Pinned chunks survive eviction pressure once cached.
    blob = b"x" * 400_000
    assert cache.put(a[0], blob)
    assert cache.put(b[1], blob)
    assert cache.put("other/k.bin", blob)
    assert cache.contains(a[0]) and not cache.contains(b[1])


def _until(condition: Callable[[], bool], bound_s: float = 30.0) -> bool:
    """Poll `condition()` until true; the bound only ends a broken run (this is not a timing check)."""
    deadline = time.monotonic() + bound_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_pin_sync_loop_follows_the_bucket(s3_store: ObjectStore, cache: NVMeCache) -> None:
    keys = _keys(32)
    loop = PinSyncLoop(cache, s3_store, interval_s=0.05)
    try:
        create_pin(s3_store, "made-elsewhere", NS, keys)
        assert _until(lambda: all(cache.pinned(k) == 1 for k in keys))
        delete_pin(s3_store, "made-elsewhere")
        assert _until(lambda: all(cache.pinned(k) == 0 for k in keys))
    finally:
        loop.stop()


def test_load_namespace(s3_store: ObjectStore) -> None:
    with pytest.raises(NamespaceNotFound):
        load_namespace(s3_store, NS.id)
    s3_store.put(NS.config_key, json.dumps(NS.fields()).encode())
    assert load_namespace(s3_store, NS.id).id == NS.id
    assert load_namespace(s3_store, NS.id, rank=1).chunk_key(b"\x00" * 36).startswith(f"{NS.id}_r1/")
    with pytest.raises(ConfigError):
        load_namespace(s3_store, "a/b")


def test_prompt_and_messages_match_transformers(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    prompt = "the cache key of a shared prefix " * 20
    assert tokens_from_prompt(model_dir, prompt) == hf(prompt)["input_ids"]
    messages = [{"role": "system", "content": "You are a helpful storage agent. " * 10}]
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert tokens_from_messages(model_dir, messages) == list(expected)
    # The system-only head is a token prefix of the whole conversation, so its full chunks are shared.
    full = [*messages, {"role": "user", "content": "hello"}]
    head, whole = tokens_from_messages(model_dir, messages), tokens_from_messages(model_dir, full)
    assert whole[: len(head)] == head
    assert block_hashes(head, 16) == block_hashes(whole, 16)[: len(head) // 16]


def test_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        tokens_from_prompt(tmp_path, "x")
    with pytest.raises(ConfigError, match="tokenizer_config"):
        tokens_from_messages(tmp_path, [{"role": "system", "content": "x"}])
