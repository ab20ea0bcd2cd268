"""The pins API: create, list, read and delete pin manifests in the node's bucket (`/v1/pins`).

Creating a pin computes the chunk keys (`kvstore.admin.chunk_request`: from token ids, or a prompt or chat
messages the serving engine tokenizes, hashed as the namespace's engines hash) and writes the manifest. Nodes
pick a pin up through `kvstore.pin_sync.apply_pins`, which this service runs for its own node after every
create and delete (the answer's `node_pins` says what changed, or why it could not); `present_chunks` says
how many of its chunks the bucket holds. Errors map to 404 (unknown pin or namespace), 409 (name taken), 413
(body too large), 422 (bad input, a seed no engine of the namespace uses, or more tokens or chunks than
`admin_max_tokens` / `admin_max_chunks`) and 503 (store or vLLM endpoint unavailable), each as JSON
`{"detail": ...}`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Annotated, Any, Self

import httpx
from fastapi import APIRouter, Depends, HTTPException, Path, Response, status
from pydantic import BaseModel

from kvstore.admin.auth import require_token
from kvstore.admin.chunk_request import PIN_NAME_SCHEMA, TOKENIZE_TIMEOUT_S, PinIn, prepare
from kvstore.admin.deps import NodeDep
from kvstore.admin.openapi import AUTH_ERRORS, errors
from kvstore.errors import ConfigError, KVStoreError
from kvstore.pin_sync import apply_pins
from kvstore.pins import (
    NamespaceNotFound,
    PinExists,
    PinManifest,
    PinNotFound,
    create_pin,
    delete_pin,
    get_pin,
    list_pins,
    present_chunks,
)
from kvstore.runtime import Node

__all__ = ["PinCreatedOut", "PinListOut", "PinOut", "PinReadOut", "router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], tags=["pins"], responses=AUTH_ERRORS)

PinName = Annotated[str, Path(json_schema_extra=PIN_NAME_SCHEMA)]


class PinOut(BaseModel):
    """A pin manifest as the bucket holds it (`kvstore.pins.PinManifest`), and whether its TTL has passed."""

    name: str
    namespace: str
    namespace_fields: dict[str, Any]
    keys: list[str]
    created_at: float
    expires_at: float | None
    expired: bool

    @classmethod
    def of(cls, manifest: PinManifest, **more: Any) -> Self:
        return cls(**manifest.to_json(), expired=manifest.expired(), **more)


class PinReadOut(PinOut):
    """A pin manifest, and how many of its chunks the bucket holds now."""

    present_chunks: int


class PinCreatedOut(PinReadOut):
    """A new pin: the manifest, the tokens and key scheme it was computed with, and what changed in this
    node's cache pins (`node_pins`: pinned / unpinned / total, or the error that kept them as they were)."""

    num_tokens: int
    hash_algo: str | None
    seed_fingerprint: str
    warnings: list[str]
    node_pins: dict[str, Any]


class PinListOut(BaseModel):
    pins: list[PinOut]


@router.post("/pins", status_code=status.HTTP_201_CREATED, responses=errors(400, 404, 409, 413, 422, 503))
def create(body: PinIn, node: NodeDep) -> PinCreatedOut:
    try:
        with httpx.Client(timeout=TOKENIZE_TIMEOUT_S) as http:
            ready = prepare(body, node, http, what="pin")
        manifest = create_pin(
            node.store, body.name, ready.namespace, ready.keys, ttl_seconds=body.ttl_seconds
        )
    except NamespaceNotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None
    except PinExists as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
    except ConfigError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None
    return PinCreatedOut.of(
        manifest,
        num_tokens=len(ready.tokens),
        present_chunks=present_chunks(node.store, manifest.keys),
        hash_algo=ready.scheme.hash_algo,
        seed_fingerprint=ready.scheme.seed_fingerprint,
        warnings=ready.warnings,
        node_pins=_apply_here(node),
    )


def _apply_here(node: Node) -> dict[str, Any]:
    """Bring this node's cache pins in line with the bucket. The manifest change already stands, so a
    failure here is reported in the answer (and retried by the next create or delete), not raised."""
    try:
        return asdict(apply_pins(node.cache, node.store))
    except KVStoreError as exc:
        log.warning("could not apply pins to this node's cache: %s", exc)
        return {"error": str(exc)}


@router.get("/pins", responses=errors(422, 503))
def list_all(node: NodeDep, include_expired: bool = True) -> PinListOut:
    pins = list_pins(node.store, include_expired=include_expired)
    return PinListOut(pins=[PinOut.of(p) for p in pins])


@router.get("/pins/{name}", responses=errors(404, 422, 503))
def read(name: PinName, node: NodeDep) -> PinReadOut:
    """The manifest, and how many of its chunks the bucket holds now (`present_chunks`)."""
    try:
        manifest = get_pin(node.store, name)
        return PinReadOut.of(manifest, present_chunks=present_chunks(node.store, manifest.keys))
    except PinNotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None
    except ConfigError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None


@router.delete("/pins/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=errors(404, 422, 503))
def remove(name: PinName, node: NodeDep) -> Response:
    try:
        delete_pin(node.store, name)
    except PinNotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None
    except ConfigError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None
    _apply_here(node)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
