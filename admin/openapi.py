"""What the admin API's OpenAPI schema promises beyond FastAPI's defaults, so clients (and schemathesis) can
rely on it.

- Every error is JSON `{"detail": ...}`: a message string for errors the routes raise, a list of problems for
  request validation (FastAPI's own 422). `errors(...)` builds a route's `responses=` entry from status codes.
- `JsonInt` (and its positive / non-negative forms): an integer as JSON Schema means it (`600` and `600.0`,
  never `true` or `"600"`), for request models that are otherwise strict.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field

__all__ = ["AUTH_ERRORS", "ErrorOut", "JsonInt", "NonNegativeJsonInt", "PositiveJsonInt", "errors"]

_DESCRIPTIONS = {
    400: "The body cannot be parsed (not UTF-8 JSON)",
    401: "No bearer token (an admin token is configured)",
    403: "Wrong bearer token",
    404: "Not found",
    409: "Conflict",
    413: "The body is larger than the service accepts (`admin_max_body_bytes`)",
    422: "Malformed or invalid input",
    503: "The object store or the NVMe cache cannot be used right now",
}


class ErrorOut(BaseModel):
    """An error answer: a message, or FastAPI's list of validation problems."""

    detail: str | list[dict[str, Any]]


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorOut, "description": _DESCRIPTIONS[code]} for code in codes}


AUTH_ERRORS = errors(401, 403)


def _json_integer(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value  # anything else goes to strict int validation as it is


# Constraints go inside, before the validator, so the schema states them as JSON Schema keywords.
JsonInt = Annotated[int, BeforeValidator(_json_integer)]
PositiveJsonInt = Annotated[int, Field(gt=0), BeforeValidator(_json_integer)]
NonNegativeJsonInt = Annotated[int, Field(ge=0), BeforeValidator(_json_integer)]
