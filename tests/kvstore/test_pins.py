"""Pin manifests in a real S3 bucket: create, read, list, expire, delete, validate; namespaces."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator

import pytest

from kvstore import pins as pins_module
from kvstore.cache.records import MAX_KEY_BYTES
from kvstore.errors import ConfigError
from kvstore.hashing import chunk_keys
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.layout import PIN_DELETE_PREFIX, PIN_PREFIX
from kvstore.pins import (
    NamespaceNotFound,
    PinExists,
    PinNotFound,
    create_pin,
    delete_pin,
    get_pin,
    list_pins,
    load_namespace,
    pinned_keys,
    validate_pin_name,
)
from kvstore.stores.base import ObjectStore
from kvstore.stores.s3 import S3Options, S3Store
from tests.conftest import S3Server
from tests.helpers import wait_for

NS = Namespace(
    model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(16, ("l0",)),)
)


def _keys(n_tokens: int, start: int = 0) -> list[str]:
    return chunk_keys(NS, list(range(start, start + n_tokens)))


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
    wait_for(lambda: pinned_keys(s3_store) == set(_keys(32)), timeout=10, what="the short pin to expire")
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


def test_load_namespace(s3_store: ObjectStore) -> None:
    with pytest.raises(NamespaceNotFound):
        load_namespace(s3_store, NS.id)
    s3_store.put(NS.config_key, json.dumps(NS.fields()).encode())
    assert load_namespace(s3_store, NS.id).id == NS.id
    assert load_namespace(s3_store, NS.id, rank=1).chunk_key(b"\x00" * 36).startswith(f"{NS.id}_r1/")
    with pytest.raises(ConfigError):
        load_namespace(s3_store, "a/b")


def _delete_racing(store: ObjectStore, name: str, n: int) -> list[str]:
    """`delete_pin(store, name)` from `n` threads released at once: what each one got."""
    barrier = threading.Barrier(n)
    outcomes: list[str] = []

    def delete() -> None:
        barrier.wait()
        try:
            delete_pin(store, name)
            outcomes.append("deleted")
        except PinNotFound:
            outcomes.append("not found")

    threads = [threading.Thread(target=delete) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


@pytest.fixture
def patient_store(s3_server: S3Server, s3_bucket: str) -> Iterator[S3Store]:
    """A store whose data path waits long. SeaweedFS answers racing create-only writes of one key one after
    another, a second apart: the fifth loser of six waits about 4 s, all the default data path allows."""
    with s3_server.store(s3_bucket, options=S3Options(read_timeout=30.0, deadline=60.0)) as store:
        yield store


def test_racing_deletes_exactly_one_wins(patient_store: S3Store) -> None:
    for round_ in range(5):
        create_pin(patient_store, f"racy{round_}", NS, _keys(32))
        outcomes = _delete_racing(patient_store, f"racy{round_}", 6)
        assert sorted(outcomes) == ["deleted"] + ["not found"] * 5, outcomes
    # A pin made again under a deleted name is a new version: deleting it works.
    create_pin(patient_store, "racy0", NS, _keys(16))
    delete_pin(patient_store, "racy0")
    assert list_pins(patient_store) == []


def test_a_delete_whose_winner_died_is_finished_by_the_next(
    s3_store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    create_pin(s3_store, "orphan", NS, _keys(16))
    raw = s3_store.get(f"{PIN_PREFIX}orphan.json") or b""
    # The claim of a delete that crashed before deleting.
    s3_store.put(f"{PIN_DELETE_PREFIX}orphan/{hashlib.sha256(raw).hexdigest()[:32]}", b"")
    monkeypatch.setattr(pins_module, "_DELETE_WAIT_S", 0.2)
    delete_pin(s3_store, "orphan")
    with pytest.raises(PinNotFound):
        get_pin(s3_store, "orphan")


def test_keys_too_long_for_the_node_cache_are_refused_naming_the_limit(s3_store: ObjectStore) -> None:
    # 200 characters, three UTF-8 bytes each: the keys are over 600 bytes.
    long = Namespace(model_name="\u20ac" * 200, tokens_per_hash=16, dtype="bfloat16")
    keys = chunk_keys(long, list(range(32)))
    with pytest.raises(ConfigError, match=f"{MAX_KEY_BYTES}-byte"):
        create_pin(s3_store, "long", long, keys)
    assert list_pins(s3_store) == []


def test_manifests_with_invalid_text_are_skipped_by_every_reader(s3_store: ObjectStore) -> None:
    create_pin(s3_store, "good", NS, _keys(32))
    doc = json.loads(s3_store.get(f"{PIN_PREFIX}good.json") or b"")
    doc.update(name="bad", keys=[*doc["keys"][:1], "\ud800.bin"])
    s3_store.put(f"{PIN_PREFIX}bad.json", json.dumps(doc).encode())  # escaped: valid JSON, invalid text
    assert [p.name for p in list_pins(s3_store)] == ["good"]
    with pytest.raises(ConfigError, match="malformed"):
        get_pin(s3_store, "bad")
    delete_pin(s3_store, "bad")
    bad_fields = Namespace(model_name="org/tiny", tokens_per_hash=16, dtype="bf\ud800")
    with pytest.raises(ConfigError, match="Unicode"):
        create_pin(s3_store, "p", bad_fields, chunk_keys(bad_fields, list(range(16))))
