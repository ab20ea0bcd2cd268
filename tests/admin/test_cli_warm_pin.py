"""`kvstore pin add` and `kvstore warm` as an operator runs them: prompts tokenized by the configured vLLM
endpoint (a stand-in with the tiny model's real tokenizer), keys hashed like the namespace's engines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.hashing import chunk_keys
from kvstore.key_scheme import record_scheme, scheme_for
from kvstore.keys import Namespace
from kvstore.pins import get_pin
from kvstore.prompts import tokens_from_prompt
from tests.admin.vllm_standin import VLLMStandIn
from tests.helpers import cli_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KVSTORE = [sys.executable, "-m", "kvstore.admin.cli"]
NS = Namespace(model_name="org/tiny", tokens_per_hash=16, dtype="bfloat16")
PROMPT = "You are the storage agent of this fleet. " * 12


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVSTORE, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def env(tmp_path: Path, s3_server: Any, s3_store: Any, vllm: VLLMStandIn) -> dict[str, str]:
    s3_store.put(NS.config_key, json.dumps(NS.fields()).encode())
    return cli_env(
        tmp_path,
        KVSTORE_STORE_URL=f"s3://{s3_store.bucket}/{s3_store.prefix}",
        KVSTORE_S3_ENDPOINT=s3_server.endpoint,
        KVSTORE_CACHE_DIR=str(tmp_path / "cache"),
        KVSTORE_VLLM_URLS=json.dumps([vllm.url]),
        AWS_ACCESS_KEY_ID=s3_server.access_key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
    )


def test_pin_add_tokenizes_through_the_engine_and_counts_present_chunks(
    env: dict[str, str], s3_store: Any, vllm: VLLMStandIn
) -> None:
    record_scheme(s3_store, NS, scheme_for())
    added = run(env, "pin", "add", "system", "--namespace", NS.id, "--prompt", PROMPT)
    assert added.returncode == 0, added.stdout + added.stderr
    expected = chunk_keys(NS, tokens_from_prompt(vllm.model_dir, PROMPT))
    assert list(get_pin(s3_store, "system").keys) == expected and expected
    assert f"pinned {len(expected)} chunks as 'system'; 0 of them are in the bucket now" in added.stdout
    assert vllm.calls("POST /tokenize") == [{"model": "tiny", "prompt": PROMPT, "add_special_tokens": True}]
    s3_store.put(expected[0], b"x")
    listing = run(env, "pin", "ls")
    assert listing.returncode == 0 and "in bucket" in listing.stdout and " 1 " in listing.stdout


def test_pin_add_and_warm_refuse_a_seed_the_engines_do_not_use(env: dict[str, str], s3_store: Any) -> None:
    record_scheme(s3_store, NS, scheme_for("sha256", "99"))  # the engines run with PYTHONHASHSEED=99
    tokens = ",".join(str(t) for t in range(64))
    pinned = run(env, "pin", "add", "p", "--namespace", NS.id, "--token-ids", tokens)
    assert pinned.returncode == 2 and "PYTHONHASHSEED" in pinned.stderr, pinned.stderr
    warmed = run(env, "warm", "--namespace", NS.id, "--token-ids", tokens)
    assert warmed.returncode == 2 and "PYTHONHASHSEED" in warmed.stderr, warmed.stderr
    same = run(
        {**env, "PYTHONHASHSEED": "99"}, "pin", "add", "p", "--namespace", NS.id, "--token-ids", tokens
    )
    assert same.returncode == 0, same.stderr
    assert list(get_pin(s3_store, "p").keys) == chunk_keys(NS, list(range(64)), seed="99")


def test_warm_asks_the_configured_engine_for_missing_chunks(
    env: dict[str, str], s3_store: Any, vllm: VLLMStandIn
) -> None:
    record_scheme(s3_store, NS, scheme_for())
    warmed = run(env, "warm", "--namespace", NS.id, "--prompt", PROMPT, "--served-model", "tiny")
    # The stand-in stores nothing, so the chunks stay missing (exit 1) after the engine was asked once.
    assert warmed.returncode == 1, warmed.stdout + warmed.stderr
    tokens = tokens_from_prompt(vllm.model_dir, PROMPT)
    assert vllm.calls("POST /v1/completions") == [
        {"model": "tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0}
    ]
