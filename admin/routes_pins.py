"""The pins API: create, list, read and delete pin manifests in the node's bucket (`/v1/pins`).

Creating a pin computes the chunk keys (token ids, a prompt or chat messages, hashed like vLLM) and writes the
manifest; nodes pick it up through `kvstore.pins.apply_pins`. Errors map to 404 (unknown pin or namespace),
409 (name taken) and 422 (bad input), each as JSON `{"detail": ...}`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request, Response, status
from kvstore.admin.auth import require_token
from pydantic import BaseModel, Field, model_validator

from kvstore.errors import ConfigError
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.pins import (
    NamespaceNotFound,
    PinExists,
    PinManifest,
    PinNotFound,
    create_pin,
    delete_pin,
    get_pin,
    keys_for_tokens,
    list_pins,
    load_namespace,
    tokens_from_messages,
    tokens_from_prompt,
)
from kvstore.runtime import Node

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], tags=["pins"])


class GroupIn(BaseModel):
    tokens_per_block: int = Field(gt=0)
    layer_names: list[str]


class PinIn(BaseModel):
    """One of `namespace` or `model` (+ layout fields); one of `token_ids`, `prompt`, `messages`."""

    name: str
    namespace: str | None = None
    rank: int = Field(default=0, ge=0)
    model: str | None = None
    tokens_per_hash: int | None = Field(default=None, gt=0)
    dtype: str | None = None
    kv_cache_groups: list[GroupIn] = []
    tp_size: int = 1
    pp_size: int = 1
    blocks_per_file: int = 1
    parallel_agnostic: bool = False
    blocks_per_chunk: int = Field(default=1, gt=0)
    token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    model_path: str | None = None
    ttl_seconds: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_of_each(self) -> PinIn:
        if (self.namespace is None) == (self.model is None):
            raise ValueError("give exactly one of 'namespace' (an id) or 'model' (+ tokens_per_hash, dtype)")
        if self.model is not None and (self.tokens_per_hash is None or self.dtype is None):
            raise ValueError("'model' needs 'tokens_per_hash' and 'dtype'")
        given = [k for k in ("token_ids", "prompt", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'token_ids', 'prompt' or 'messages'")
        if given[0] != "token_ids" and not self.model_path:
            raise ValueError(f"'{given[0]}' needs 'model_path' (the directory holding the tokenizer)")
        return self


def _node(request: Request) -> Node:
    node: Node = request.app.state.node
    return node


def _out(manifest: PinManifest) -> dict[str, Any]:
    return {**manifest.to_json(), "expired": manifest.expired()}


def _namespace(body: PinIn, node: Node) -> Namespace:
    if body.namespace is not None:
        return load_namespace(node.store, body.namespace, rank=body.rank)
    assert body.model is not None and body.tokens_per_hash is not None and body.dtype is not None
    return Namespace(
        model_name=body.model,
        tokens_per_hash=body.tokens_per_hash,
        dtype=body.dtype,
        kv_cache_groups=tuple(
            KVCacheGroup(g.tokens_per_block, tuple(g.layer_names)) for g in body.kv_cache_groups
        ),
        tp_size=body.tp_size,
        pp_size=body.pp_size,
        rank=body.rank,
        blocks_per_file=body.blocks_per_file,
        parallel_agnostic=body.parallel_agnostic,
    )


def _tokens(body: PinIn) -> list[int]:
    if body.token_ids is not None:
        return body.token_ids
    assert body.model_path is not None
    if body.prompt is not None:
        return tokens_from_prompt(body.model_path, body.prompt)
    assert body.messages is not None
    return tokens_from_messages(body.model_path, body.messages)


@router.post("/pins", status_code=status.HTTP_201_CREATED)
def create(body: PinIn, request: Request) -> dict[str, Any]:
    node = _node(request)
    try:
        namespace = _namespace(body, node)
        tokens = _tokens(body)
        keys = keys_for_tokens(namespace, tokens, blocks_per_chunk=body.blocks_per_chunk)
        if not keys:
            raise ConfigError(
                f"{len(tokens)} tokens make no full chunk "
                f"(tokens_per_hash={namespace.tokens_per_hash}); nothing to pin"
            )
        manifest = create_pin(node.store, body.name, namespace, keys, ttl_seconds=body.ttl_seconds)
    except NamespaceNotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None
    except PinExists as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
    except ConfigError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None
    return {**_out(manifest), "num_tokens": len(tokens)}


@router.get("/pins")
def list_all(request: Request, include_expired: bool = True) -> dict[str, Any]:
    pins = list_pins(_node(request).store, include_expired=include_expired)
    return {"pins": [_out(p) for p in pins]}


@router.get("/pins/{name}")
def read(name: str, request: Request) -> dict[str, Any]:
    try:
        return _out(get_pin(_node(request).store, name))
    except PinNotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None
    except ConfigError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None


@router.delete("/pins/{name}", status_code=status.HTTP_204_NO_CONTENT)
def remove(name: str, request: Request) -> Response:
    try:
        delete_pin(_node(request).store, name)
    except PinNotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None
    except ConfigError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None
    return Response(status_code=status.HTTP_204_NO_CONTENT)
