"""What one admin request may cost: a body size limit (413) and token and chunk limits for pin and warm
requests (422), plus JSON-safe error answers: a validation error echoes the input back, and neither an odd
number (NaN, an infinity) nor text no UTF-8 encodes (a lone surrogate such as `"\\ud800"`) may turn it into a
500.

The limits come from the settings (`admin_max_body_bytes`, `admin_max_tokens`, `admin_max_chunks`), so a
request's memory and time are bounded before any token is hashed: a chunk key costs one hash per block of
`tokens_per_hash` tokens, which is what made a million tokens at `tokens_per_hash=1` take a minute and
gigabytes.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstore.errors import ConfigError
from kvstore.keys import Namespace

__all__ = ["BodyLimit", "check_tokens", "http_error", "json_safe", "safe_text", "validation_error"]


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` answers 413, by its Content-Length before anything
    is read, or as soon as a streamed body passes the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._too_large(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # FastAPI re-raises an HTTPException met while reading the body: it becomes the answer.
                    raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"request body larger than {self.max_bytes} bytes (admin_max_body_bytes)"

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse({"detail": self._message()}, status_code=status.HTTP_413_CONTENT_TOO_LARGE)
        await response(scope, receive, send)


def check_tokens(
    namespace: Namespace, tokens: int, *, blocks_per_chunk: int, max_tokens: int, max_chunks: int
) -> None:
    """`ConfigError` (422) when a request's tokens, or the hashes and chunk keys they make, pass the limits.
    Counted from the lengths alone, before anything is hashed."""
    if tokens > max_tokens:
        raise ConfigError(
            f"{tokens} tokens is more than one request may carry ({max_tokens}, admin_max_tokens)"
        )
    blocks = tokens // namespace.tokens_per_hash
    sizes = [g.tokens_per_block for g in namespace.kv_cache_groups] or [namespace.tokens_per_hash]
    keys = sum(tokens // (size * blocks_per_chunk) for size in sizes)
    if max(blocks, keys) > max_chunks:
        raise ConfigError(
            f"{tokens} tokens make {blocks} blocks to hash and {keys} chunk keys at "
            f"tokens_per_hash={namespace.tokens_per_hash}: more than one request may ({max_chunks}, "
            "admin_max_chunks)"
        )


def safe_text(text: str) -> str:
    """`text`, with what UTF-8 cannot encode (lone surrogates) written as a `\\udXXX` escape instead."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


def json_safe(value: Any) -> Any:
    """`value` (JSON-like) with whatever JSON or UTF-8 cannot carry made text: non-finite numbers as their
    names, unencodable strings (values and keys) escaped."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # 'nan', 'inf', '-inf': JSON has no such numbers
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, dict):
        return {json_safe(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 for invalid input, with the offending values made JSON-safe: its own handler echoes the
    input back and fails to encode NaN, an infinity (a JSON `1e999`) or a lone surrogate, turning bad input
    into a 500."""
    assert isinstance(exc, RequestValidationError)
    detail = json_safe(jsonable_encoder(exc.errors()))
    return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


async def http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's answer to an `HTTPException`, with its detail made JSON-safe (a message may quote input)."""
    assert isinstance(exc, HTTPException)
    safe = HTTPException(exc.status_code, json_safe(exc.detail), exc.headers)
    return await http_exception_handler(request, safe)
