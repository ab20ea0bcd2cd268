"""Schemathesis over the admin API's OpenAPI schema, against a real node (real S3 server, real NVMe cache).

Every operation is fuzzed with valid and invalid input, authenticated with the admin token; the checks are
schemathesis' defaults: no 5xx, status codes, content types and bodies as the schema documents them, invalid
input rejected, auth enforced. Warm jobs may try to reach a vLLM URL; the app bounds connection attempts, and
the fixture waits (bounded) for background jobs so none outlives the bucket.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from kvstore.admin.app import create_app
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from kvstore.keys import KVCacheGroup, Namespace
from kvstore.runtime import Node

pytestmark = pytest.mark.integration

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Per operation and mode: the default run stays well under a minute; raise it for a deeper hunt.
EXAMPLES = int(os.environ.get("KVSTORE_FUZZ_EXAMPLES", "25"))
NS = Namespace(
    model_name="org/tiny", tokens_per_hash=4, dtype="bfloat16", kv_cache_groups=(KVCacheGroup(4, ("l0",)),)
)


@pytest.fixture
def node(s3_server: Any, s3_store: Any, open_test_node: Callable[..., Node]) -> Node:
    url = f"s3://{s3_store.bucket}/{s3_store.prefix}"
    opened = open_test_node(s3_server, url, cache_bytes=4 << 20, admin_token=TOKEN)
    # A published namespace and a pin, so that reads and deletes sometimes find something.
    opened.store.put(NS.config_key, json.dumps(NS.fields()).encode())
    return opened


@pytest.fixture
def app(node: Node) -> Iterator[FastAPI]:
    app = create_app(node)
    yield app
    _wait_for_jobs(app, timeout_s=30)


def _wait_for_jobs(app: FastAPI, timeout_s: float) -> None:
    """GC and warm jobs run on background threads; let them finish before the bucket is emptied."""
    registry = getattr(app.state, "jobs", None)
    if registry is None:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with registry._lock:
            busy = [j for j in registry._jobs.values() if j.status in ("pending", "running", "cancelling")]
        if not busy:
            return
        time.sleep(0.1)


# The body rules of POST /v1/pins and /v1/warm that JSON Schema cannot state (enough tokens for one full
# chunk, a `model_path` that holds a tokenizer) make schema-valid bodies a 4xx there, by design.
CROSS_FIELD = {"POST /v1/pins", "POST /v1/warm"}


def _fuzz(operation: Any, mode: GenerationMode, examples: int) -> None:
    excluded = [positive_data_acceptance] if operation.label in CROSS_FIELD else []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        case.call_and_validate(headers=AUTH, excluded_checks=excluded)

    run()


def test_every_operation_never_5xx_and_conforms(app: FastAPI) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    # The token goes with every request; the auth check itself probes without it and with a wrong one.
    schema.config.generation.update(with_security_parameters=False)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len({op.label for op in operations}) == 11  # every route of the API is in the schema
    failures: list[str] = []
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _fuzz(operation, mode, EXAMPLES)
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # e.g. /healthz: no input that could be invalid
            except (Exception, BaseExceptionGroup) as exc:  # every operation's failures, reported together
                failures.append(f"{operation.label} [{mode.value}]: {exc}")
    assert not failures, "\n\n".join(failures)
