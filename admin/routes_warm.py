"""Admin route for warming: `POST /v1/warm`, which starts a job.

A warm request names the namespace, the prompt and the served model exactly like a pin request
(`kvstore.admin.chunk_request.PinIn`, whose validation, tokenization through the engine and key scheme check
this module reuses). Everything is checked before answering, so bad input is a 4xx at once (404 unknown
namespace, 422 malformed or a seed no engine of the namespace uses); the warming itself (prefetching, the
prefill that produces missing chunks, waiting for uploads) runs as a job of the app's registry
(`kvstore.admin.jobs`, polled with `GET /v1/jobs/{id}`). The prefill goes to the configured endpoint
(`vllm_urls`) that serves `served_model`, never to a URL from the request, and nothing the server answers is
copied into the job.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
from fastapi import APIRouter, Depends, HTTPException, status
from pydantic import Field, field_validator
from typing_extensions import override

from kvstore.admin.auth import require_token
from kvstore.admin.chunk_request import PIN_NAME_SCHEMA, TOKENIZE_TIMEOUT_S, PinIn, prepare, served_model
from kvstore.admin.deps import JobsDep, NodeDep
from kvstore.admin.jobs import JobAccepted
from kvstore.admin.openapi import AUTH_ERRORS, errors
from kvstore.errors import ConfigError
from kvstore.pins import NamespaceNotFound, validate_pin_name
from kvstore.warm import warm

__all__ = ["WarmAccepted", "WarmIn", "router"]

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], tags=["warm"], responses=AUTH_ERRORS)


# mypy sees `kvstore.admin.*` as untyped (the folder is mapped by setuptools), hence the ignore.
class WarmIn(PinIn):  # type: ignore[misc,unused-ignore]
    """Body of `POST /v1/warm`: the pin request's namespace, prompt and served model, plus what to do.

    With `produce` and a configured vLLM endpoint, missing chunks are produced by one prefill on the endpoint
    serving `served_model`. `pin` names a pin manifest to write for the chunks (`ttl_seconds` is its TTL);
    `name` is not used."""

    name: str = Field(default="", max_length=128, description="unused by /v1/warm (see 'pin')")
    produce: bool = True
    prefetch: bool = True
    pin: str | None = Field(default=None, json_schema_extra=PIN_NAME_SCHEMA)
    timeout_s: float = Field(default=120.0, gt=0, le=3600, allow_inf_nan=False)
    poll_s: float = Field(default=15.0, ge=0, le=3600, allow_inf_nan=False)

    @field_validator("pin")
    @classmethod
    def _pin_name(cls, value: str | None) -> str | None:
        return None if value is None else validate_pin_name(value)


class WarmAccepted(JobAccepted):  # type: ignore[misc,unused-ignore]
    """The 202 answer of `POST /v1/warm`: the job, and what the request resolved to."""

    namespace: str
    num_tokens: int
    warnings: list[str]


class CancellableTransport(httpx.BaseTransport):
    """HTTP for a warm job's vLLM requests, each sent from a helper thread so that cancelling the job ends
    the wait at once (a blocked socket read cannot be interrupted from another thread); the abandoned
    request ends by itself at its own timeout."""

    def __init__(self, cancel: threading.Event) -> None:
        self._inner = httpx.HTTPTransport()
        self._cancel = cancel

    @override
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        outcome: list[httpx.Response | BaseException] = []
        done = threading.Event()

        def send() -> None:
            try:
                response = self._inner.handle_request(request)
                try:
                    content = response.read()
                finally:
                    response.close()
                outcome.append(
                    httpx.Response(response.status_code, headers=response.headers, content=content)
                )
            except BaseException as exc:  # handed to the waiting job thread
                outcome.append(exc)
            finally:
                done.set()

        if self._cancel.is_set():
            raise httpx.ConnectError("the job was cancelled", request=request)
        threading.Thread(target=send, name="kvstore-warm-http", daemon=True).start()
        while not done.wait(0.1):
            if self._cancel.is_set():
                raise httpx.ConnectError("the job was cancelled", request=request)
        result = outcome[0]
        if isinstance(result, BaseException):
            raise result
        return result

    @override
    def close(self) -> None:
        self._inner.close()


@router.post("/warm", status_code=status.HTTP_202_ACCEPTED, responses=errors(400, 404, 413, 422, 503))
def start_warm(body: WarmIn, node: NodeDep, jobs: JobsDep) -> WarmAccepted:
    try:
        with httpx.Client(timeout=TOKENIZE_TIMEOUT_S) as http:
            ready = prepare(body, node, http, what="warm")
    except NamespaceNotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None
    except ConfigError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None
    job = jobs.create("warm")
    # A cancelled job stops waiting for vLLM at once (DELETE /v1/jobs/{id}).
    http = httpx.Client(timeout=body.timeout_s, transport=CancellableTransport(job.cancel))
    produce = body.produce and bool(node.settings.vllm_urls)

    def work() -> dict[str, Any]:
        with http:
            served = ready.served or (served_model(body, node, http) if produce else None)
            report = warm(
                node,
                ready.namespace,
                ready.tokens,
                vllm=served if produce else None,
                prefetch=body.prefetch,
                pin=body.pin,
                pin_ttl_s=body.ttl_seconds,
                blocks_per_chunk=body.blocks_per_chunk,
                timeout_s=body.timeout_s,
                poll_s=body.poll_s,
                client=http,
                cancel=job.cancel,
            )
            out = report.as_dict()
            if body.produce and not produce and report.still_missing:
                out["errors"].append("no vLLM endpoint is configured (vllm_urls) to produce missing chunks")
            return out

    accepted = WarmAccepted(
        id=job.id,
        status=job.status,
        namespace=ready.namespace.id,
        num_tokens=len(ready.tokens),
        warnings=ready.warnings,
    )
    jobs.run(job, work)
    return accepted
