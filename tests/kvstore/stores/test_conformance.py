"""One behaviour contract, checked against every ObjectStore backend: memory, local directory and S3."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvstore.stores import LocalStore, MemoryStore, ObjectStore, RegionalStore
from kvstore.stores.s3 import S3Store


@pytest.fixture(params=["memory", "local", "regional", pytest.param("s3", marks=pytest.mark.integration)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "memory":
        yield MemoryStore(uuid.uuid4().hex)
    elif request.param == "regional":  # the local region must behave like any store; remotes are empty
        remote = MemoryStore(uuid.uuid4().hex)
        with RegionalStore(MemoryStore(uuid.uuid4().hex), [("far", remote)]) as regional:
            yield regional
    elif request.param == "local":
        yield LocalStore(tmp_path / "store")
    else:
        yield request.getfixturevalue("s3_store")


class TestObjectStoreConformance:
    def test_missing_key(self, store: ObjectStore) -> None:
        assert store.get("no/such/key") is None
        assert store.get_range("no/such/key", 0, 10) is None
        assert store.exists_many(["no/such/key"]) == [False]
        assert not store.exists("no/such/key")

    def test_closing_twice_is_harmless(self, store: ObjectStore) -> None:
        store.put("k", b"v")
        assert store.exists_many(["k", "other"]) == [True, False]  # pools and threads a backend starts
        store.close()
        store.close()  # and the fixture may close it once more

    def test_round_trip(self, store: ObjectStore) -> None:
        data = bytes(range(256)) * 64
        store.put("a/b/c.bin", data)
        assert store.get("a/b/c.bin") == data
        assert store.exists("a/b/c.bin")

    def test_empty_object(self, store: ObjectStore) -> None:
        store.put("empty", b"")
        assert store.get("empty") == b""
        assert store.exists("empty")

    def test_ranged_reads(self, store: ObjectStore) -> None:
        store.put("r", b"0123456789")
        assert store.get_range("r", 0, 4) == b"0123"
        assert store.get_range("r", 3, 4) == b"3456"
        assert store.get_range("r", 8, 100) == b"89"  # runs past the end: shortened
        assert store.get_range("r", 10, 5) == b""  # starts at the end: empty, not missing
        assert store.get_range("r", 50, 5) == b""
        assert store.get_range("r", 2, 0) == b""
        with pytest.raises(ValueError):
            store.get_range("r", -1, 2)

    def test_overwrite(self, store: ObjectStore) -> None:
        store.put("k", b"first")
        store.put("k", b"second, longer")
        assert store.get("k") == b"second, longer"
        store.put("k", b"3")
        assert store.get("k") == b"3"

    def test_put_if_absent(self, store: ObjectStore) -> None:
        assert store.put_if_absent("once", b"winner") is True
        assert store.put_if_absent("once", b"loser") is False
        assert store.get("once") == b"winner"
        store.delete("once")
        assert store.put_if_absent("once", b"again") is True
        assert store.get("once") == b"again"

    def test_exists_many_mixed(self, store: ObjectStore) -> None:
        present = [f"e/{i:03d}" for i in range(0, 40, 2)]
        for key in present:
            store.put(key, b"x")
        keys = [f"e/{i:03d}" for i in range(40)]
        assert store.exists_many(keys) == [i % 2 == 0 for i in range(40)]
        assert store.exists_many([]) == []

    def test_delete_idempotent(self, store: ObjectStore) -> None:
        store.put("d/1", b"x")
        store.delete("d/1")
        store.delete("d/1")
        assert store.get("d/1") is None
        store.delete("never/existed")

    def test_delete_many(self, store: ObjectStore) -> None:
        for i in range(10):
            store.put(f"m/{i}", b"x")
        store.delete_many([f"m/{i}" for i in range(0, 10, 2)] + ["m/missing"])
        assert [info.key for info in store.list("m/")] == [f"m/{i}" for i in range(1, 10, 2)]
        store.delete_many([])

    def test_listing_order_prefix_start_after(self, store: ObjectStore) -> None:
        keys = ["a/b/c", "a/a/z", "a/b0", "ab/c", "a0", "b", "c/d/e/f"]
        for key in keys:
            store.put(key, key.encode())
        listed = list(store.list())
        assert [info.key for info in listed] == sorted(keys)
        assert {info.key: info.size for info in listed} == {k: len(k) for k in keys}
        assert all(info.last_modified > 1.0e9 for info in listed)
        assert [info.key for info in store.list("a/")] == ["a/a/z", "a/b/c", "a/b0"]
        assert [info.key for info in store.list("a/b")] == ["a/b/c", "a/b0"]
        assert [info.key for info in store.list("a")] == sorted(k for k in keys if k.startswith("a"))
        after = [info.key for info in store.list(start_after="a/a/z")]
        assert after == ["a/b/c", "a/b0", "a0", "ab/c", "b", "c/d/e/f"]
        assert [info.key for info in store.list("a", start_after="a/b0")] == ["a0", "ab/c"]
        after = [info.key for info in store.list(start_after="a/b/c/")]
        assert after == ["a/b0", "a0", "ab/c", "b", "c/d/e/f"]
        assert list(store.list("zzz")) == []

    def test_listing_byte_order_around_separator(
        self, store: ObjectStore, request: pytest.FixtureRequest
    ) -> None:
        # '-' and '.' sort before '/': a directory walk must not simply visit a directory before its siblings.
        if isinstance(store, S3Store) and request.getfixturevalue("s3_server").kind == "seaweedfs":
            # Runs, and must fail: should SeaweedFS ever list in S3 byte order, this turns red (strict).
            request.applymarker(
                pytest.mark.xfail(
                    strict=True,
                    reason="SeaweedFS lists segment by segment ('a/b' before 'a-c'), not in S3 byte order",
                )
            )
        keys = ["a/b", "a-c", "a.d", "a/a/z", "a0"]
        for key in keys:
            store.put(key, b"x")
        assert [info.key for info in store.list()] == sorted(keys)
        assert [info.key for info in store.list(start_after="a.d")] == ["a/a/z", "a/b", "a0"]

    def test_listing_is_lazy(self, store: ObjectStore) -> None:
        for i in range(5):
            store.put(f"lazy/{i}", b"x")
        iterator = store.list("lazy/")
        assert next(iterator).key == "lazy/0"

    def test_bytes_like_inputs(self, store: ObjectStore) -> None:
        buffer = bytearray(b"..payload..")
        store.put("mv", memoryview(buffer)[2:9])
        store.put("ba", buffer)
        assert store.put_if_absent("mv2", memoryview(b"xyz")) is True
        buffer[2:9] = b"changed"  # the store must have copied or sent the bytes already
        assert store.get("mv") == b"payload"
        assert store.get("ba") == b"..payload.."
        assert store.get("mv2") == b"xyz"

    def test_invalid_keys(self, store: ObjectStore) -> None:
        for bad in ["", "/abs", "trailing/", "a//b", "a/../b", "."]:
            with pytest.raises(ValueError):
                store.put(bad, b"x")

    def test_check_and_context_manager(self, store: ObjectStore) -> None:
        store.check()
        assert "://" in store.url
        assert store.url in repr(store)


@pytest.mark.integration
def test_s3_listing_pages_past_1000(s3_store: S3Store) -> None:
    keys = [f"many/{i:05d}" for i in range(1203)]
    with ThreadPoolExecutor(8) as pool:  # parallel PUTs keep this quick
        list(pool.map(lambda key: s3_store.put(key, b""), keys))
    assert [info.key for info in s3_store.list("many/")] == keys
    assert [info.key for info in s3_store.list("many/", start_after=keys[999])] == keys[1000:]
    s3_store.delete_many(keys)
    assert list(s3_store.list("many/")) == []
