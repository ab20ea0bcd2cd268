"""Key schemes in the namespace folder: what the engines compute, checked by the tools that compute keys
outside them (pins, warming). Real stores: the in-process one and the S3 server of the fixtures."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore.hashing import none_hash
from kvstore.key_scheme import (
    KeyScheme,
    SeedMismatch,
    check_scheme,
    namespace_schemes,
    record_scheme,
    scheme_for,
    seed_fingerprint,
)
from kvstore.keys import Namespace
from kvstore.stores import open_store

NS = Namespace(model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16")


@pytest.fixture
def store(request: pytest.FixtureRequest) -> Any:
    return open_store(f"memory://key-scheme-{request.node.name}")


def test_the_fingerprint_names_the_seed_without_revealing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    default = scheme_for("sha256")
    assert default == scheme_for("sha256", "vllm-none-hash")  # vLLM's fixed seed when none is set
    assert default.seed_fingerprint == seed_fingerprint(none_hash("sha256"))
    assert none_hash("sha256").hex()[:16] != default.seed_fingerprint
    assert len({default, scheme_for("sha256", "0"), scheme_for("sha256_cbor")}) == 3
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert scheme_for("sha256") == scheme_for("sha256", "0")


def test_records_accumulate_one_per_scheme(store: Any) -> None:
    assert namespace_schemes(store, NS) == []
    a, b = scheme_for("sha256"), KeyScheme(None, "0123456789abcdef", random_seed=True)
    record_scheme(store, NS, a)
    record_scheme(store, NS, a)
    record_scheme(store, NS, b)
    assert sorted(namespace_schemes(store, NS), key=lambda s: s.seed_fingerprint) == sorted(
        [a, b], key=lambda s: s.seed_fingerprint
    )
    store.put(f"{NS.id}/engines/bad.json", b"{not json")
    assert len(namespace_schemes(store, NS)) == 2  # an unreadable record is skipped, not fatal


def test_tools_hash_like_the_engines_or_refuse(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    scheme, warning = check_scheme(store, NS)
    assert scheme == scheme_for("sha256") and warning is not None and "records no key scheme" in warning

    record_scheme(store, NS, scheme_for("sha256_cbor", "42"))
    with pytest.raises(SeedMismatch, match="PYTHONHASHSEED unset"):
        check_scheme(store, NS)
    assert check_scheme(store, NS, seed="42") == (scheme_for("sha256_cbor", "42"), None)
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert check_scheme(store, NS) == (scheme_for("sha256_cbor", "42"), None)  # and the algorithm follows

    only_xxhash = Namespace(model_name="org/xx", tokens_per_hash=16, dtype="bfloat16")
    record_scheme(store, only_xxhash, KeyScheme(None, "fedcba9876543210", random_seed=True))
    with pytest.raises(SeedMismatch, match="no tool outside them can compute"):
        check_scheme(store, only_xxhash)


@pytest.mark.integration
def test_records_in_a_real_bucket(s3_store: Any) -> None:
    record_scheme(s3_store, NS, scheme_for("sha256"))
    assert check_scheme(s3_store, NS, seed="vllm-none-hash") == (scheme_for("sha256"), None)
