"""Schemathesis over the admin API's OpenAPI schema, against a real node (real S3 server, real NVMe cache).

Every operation is fuzzed with valid and invalid input, authenticated with the admin token; the checks are
schemathesis' defaults: no 5xx, status codes, content types and bodies as the schema documents them, invalid
input rejected, auth enforced. JSON cannot carry NaN or infinities, so schemathesis never sends them; a second
test puts them (NaN, Infinity, 1e999, ...) into every number field of schemathesis-generated bodies. Warm jobs
may try to reach a vLLM URL; the app bounds connection attempts, and
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
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from kvstore.admin.app import create_app
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.runtime import Node

pytestmark = [pytest.mark.integration, pytest.mark.slow]

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
    assert len({op.label for op in operations}) == 12  # every route of the API is in the schema
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


# Spelled as they arrive from clients that write non-standard JSON (Python's json, JavaScript's NaN) or big
# literals: Python parses all of them, to NaN or an infinity.
ODD_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e309"]
_MARK = "\x00odd\x00"


def _resolve(schema: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        node: Any = spec
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def _number_paths(
    schema: dict[str, Any], spec: dict[str, Any], path: tuple[Any, ...] = ()
) -> set[tuple[Any, ...]]:
    """The path (keys, 0 for "an element of the list") to every number or integer a request schema names."""
    schema = _resolve(schema, spec)
    found: set[tuple[Any, ...]] = set()
    if schema.get("type") in ("number", "integer"):
        found.add(path)
    for keyword in ("anyOf", "oneOf", "allOf"):
        for alternative in schema.get(keyword, []):
            found |= _number_paths(alternative, spec, path)
    for name, sub in schema.get("properties", {}).items():
        found |= _number_paths(sub, spec, (*path, name))
    if isinstance(schema.get("items"), dict):
        found |= _number_paths(schema["items"], spec, (*path, 0))
    return found


def _put(body: Any, path: tuple[Any, ...], value: str) -> Any:
    """`body` with `value` at `path`, creating the objects and lists on the way."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        items = list(body) if isinstance(body, list) else []
        if not items:
            items.append({} if rest and isinstance(rest[0], str) else None)
        items[0] = _put(items[0], rest, value)
        return items
    mapping = dict(body) if isinstance(body, dict) else {}
    mapping[head] = _put(mapping.get(head), rest, value)
    return mapping


def _odd_numbers(
    operation: Any, targets: list[tuple[str, tuple[Any, ...]]], client: TestClient, *, has_body: bool
) -> None:
    @given(
        case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
        target=st.sampled_from(targets),
        odd=st.sampled_from(ODD_NUMBERS),
    )
    @settings(
        max_examples=EXAMPLES * 2, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def run(case: Any, target: tuple[str, tuple[Any, ...]], odd: str) -> None:
        where, path = target
        query = dict(case.query or {})
        body = case.body if isinstance(case.body, dict) else {}
        if where == "query":
            query[path[0]] = odd
        else:
            body = _put(body, path, _MARK + odd)
        content = json.dumps(body).replace(json.dumps(_MARK + odd), odd).encode() if has_body else None
        answer = client.request(
            case.method,
            case.formatted_path,
            params=query,
            content=content,
            headers={"content-type": "application/json"},
        )
        sent = content.decode() if content is not None else query
        assert 400 <= answer.status_code < 500, f"{case.method} {case.formatted_path} {sent!r}: {answer.text}"
        assert answer.json()["detail"]

    run()


def test_non_finite_numbers_in_any_number_field_are_4xx(app: FastAPI) -> None:
    """NaN, infinities and overflowing literals, in each number field of schemathesis' valid bodies (and in
    number query parameters): always a 4xx JSON answer, never a 500 (FastAPI's own 422 cannot encode them)."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    spec = app.openapi()
    client = TestClient(app, headers=AUTH, raise_server_exceptions=False)
    covered: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        raw = operation.definition.raw
        body_schema = raw.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        paths = sorted(_number_paths(body_schema, spec), key=repr) if body_schema else []
        queries = [
            p["name"]
            for p in raw.get("parameters", [])
            if p["in"] == "query" and p.get("schema", {}).get("type") in ("number", "integer")
        ]
        if not paths and not queries:
            continue
        covered.append(operation.label)
        targets = [("body", p) for p in paths] + [("query", (q,)) for q in queries]

        _odd_numbers(operation, targets, client, has_body=body_schema is not None)
    assert set(covered) >= {"POST /v1/gc", "POST /v1/pins", "POST /v1/warm", "GET /v1/gc/reports"}
