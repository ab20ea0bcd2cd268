"""What a pin or a warm request names, resolved to chunk keys: the request body both routes take (`PinIn`;
`routes_warm.WarmIn` extends it) and `prepare`, which turns it into a namespace, tokens and keys.

Keys come from token ids, or from a prompt or chat messages that the serving engine itself tokenizes
(`POST /tokenize` of the configured vLLM endpoint that serves `served_model`, with its chat template), hashed
with the algorithm and seed the namespace's engines record (`kvstore.key_scheme`): a request never names
chunks its engines would not compute. Only the endpoints of the `vllm_urls` setting are called, and no file
a request names is read. The request limits (`kvstore.admin.limits`) are checked before anything is hashed.

Every string a request carries, nested ones in `messages` included, must be valid Unicode (a JSON
`"\\ud800"` escape makes a lone surrogate, which can be neither stored nor answered), and the ones that name
something (model, dtype, layer names, served model) are bounded and printable. Chunk keys must fit the NVMe
cache's key limit, or no node could pin or cache them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import httpx
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.config import JsonDict

from kvstore.admin.limits import check_tokens
from kvstore.admin.openapi import JsonInt, NonNegativeJsonInt, PositiveJsonInt
from kvstore.errors import ConfigError
from kvstore.hashing import DEFAULT_HASH_ALGO, chunk_keys
from kvstore.key_scheme import KeyScheme, check_scheme
from kvstore.keys import KVCacheGroup, Namespace
from kvstore.pins import NAMESPACE_ID_PATTERN, check_cache_keys, invalid_text, load_namespace
from kvstore.runtime import Node
from kvstore.vllm_api import ServedModel, VLLMError, find_served, tokenize_messages, tokenize_prompt

__all__ = [
    "PIN_NAME_SCHEMA",
    "TOKENIZE_TIMEOUT_S",
    "GroupIn",
    "Label",
    "ModelName",
    "PinIn",
    "Prepared",
    "check_limits",
    "prepare",
    "served_model",
]


def _valid_text(value: str) -> str:
    if invalid_text(value) is not None:
        raise ValueError("must be valid Unicode text (no lone surrogates)")
    return value


# What names something (a dtype, a layer): printable (no control characters), valid Unicode, bounded.
_PRINTABLE = r"^[^\x00-\x1f\x7f-\x9f]+$"
Label = Annotated[str, Field(min_length=1, max_length=256, pattern=_PRINTABLE), AfterValidator(_valid_text)]
# A model name becomes part of every chunk key: printable, and short enough for S3's key limit (the NVMe
# cache's shorter one is checked on the keys themselves, `check_cache_keys`).
ModelName = Annotated[
    str, Field(min_length=1, max_length=200, pattern=_PRINTABLE), AfterValidator(_valid_text)
]


class GroupIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    tokens_per_block: PositiveJsonInt
    layer_names: list[Label] = Field(max_length=4096)


# Pin names as `kvstore.pins.validate_pin_name` accepts them (documented; the validator is what enforces).
PIN_NAME_SCHEMA: JsonDict = {"type": "string", "pattern": r"^(?!\.\.?$)[A-Za-z0-9._-]{1,128}$"}


def _given(present: JsonDict, absent: tuple[str, ...]) -> JsonDict:
    """JSON Schema for "these fields given (not null), those absent or null"."""
    props: JsonDict = {**present, **{name: {"type": "null"} for name in absent}}
    return {"required": list(present), "properties": props}


_TEXT: JsonDict = {"type": "string", "minLength": 1}
# The cross-field rules of `PinIn._one_of_each`, stated in the schema too, so clients and fuzzers see them.
_ONE_OF_EACH: JsonDict = {
    "allOf": [
        {
            "oneOf": [
                _given({"namespace": {"type": "string"}}, ("model",)),
                _given(
                    {
                        "model": {"type": "string"},
                        "tokens_per_hash": {"type": "integer"},
                        "dtype": {"type": "string"},
                    },
                    ("namespace",),
                ),
            ]
        },
        {
            "oneOf": [
                _given({"token_ids": {"type": "array"}}, ("prompt", "messages")),
                _given({"prompt": _TEXT}, ("token_ids", "messages")),
                _given({"messages": {"type": "array"}}, ("token_ids", "prompt")),
            ]
        },
    ]
}


class PinIn(BaseModel):
    """One of `namespace` or `model` (+ layout fields); one of `token_ids`, `prompt`, `messages`.

    `served_model` names the vLLM served model (one of the configured endpoints') that tokenizes a prompt or
    messages (default: the first endpoint's first model); it may come with either namespace form."""

    # Strict: no coercion of `"1"` to a token id or of `false` to a number. Unknown fields are refused, so a
    # `vllm_url` or a `model_path` (which this service no longer takes) is a 422, never silently ignored.
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_ONE_OF_EACH)

    name: Annotated[str, AfterValidator(_valid_text)] = Field(
        max_length=128, json_schema_extra=PIN_NAME_SCHEMA
    )
    namespace: str | None = Field(
        default=None, max_length=213, json_schema_extra={"pattern": f"^{NAMESPACE_ID_PATTERN}$"}
    )
    rank: NonNegativeJsonInt = 0
    model: ModelName | None = None
    tokens_per_hash: PositiveJsonInt | None = None
    dtype: Label | None = None
    kv_cache_groups: list[GroupIn] = Field(default=[], max_length=256)
    tp_size: PositiveJsonInt = 1
    pp_size: PositiveJsonInt = 1
    blocks_per_file: PositiveJsonInt = 1
    parallel_agnostic: bool = False
    blocks_per_chunk: PositiveJsonInt = 1
    token_ids: list[JsonInt] | None = None
    prompt: Annotated[str, AfterValidator(_valid_text)] | None = Field(default=None, min_length=1)
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = False  # for `messages`: a pin wants the shared head, without one
    served_model: ModelName | None = None
    ttl_seconds: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # Every string, `messages`' nested ones and the keys of objects included: none may reach a hash, the
        # bucket or an answer (`kvstore.admin.limits` escapes the input a 422 echoes back).
        where = invalid_text(data)
        if where is not None:
            raise ValueError(f"text at {where} is not valid Unicode (a lone surrogate?)")
        return data

    @model_validator(mode="after")
    def _one_of_each(self) -> PinIn:
        if (self.namespace is None) == (self.model is None):
            raise ValueError("give exactly one of 'namespace' (an id) or 'model' (+ tokens_per_hash, dtype)")
        if self.model is not None and (self.tokens_per_hash is None or self.dtype is None):
            raise ValueError("'model' needs 'tokens_per_hash' and 'dtype'")
        given = [k for k in ("token_ids", "prompt", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'token_ids', 'prompt' or 'messages'")
        return self


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


def check_limits(namespace: Namespace, tokens: list[int], body: PinIn, node: Node) -> None:
    """The request limits of the settings (422 when passed), before any token is hashed."""
    settings = node.settings
    check_tokens(
        namespace,
        len(tokens),
        blocks_per_chunk=body.blocks_per_chunk,
        max_tokens=settings.admin_max_tokens,
        max_chunks=settings.admin_max_chunks,
    )


# Tokenizing a prompt is one short request to the engine; a slow one must not hold an API thread for long.
TOKENIZE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Prepared:
    """What a pin or warm request resolves to before any chunk is touched."""

    namespace: Namespace
    tokens: list[int]
    scheme: KeyScheme
    keys: list[str]
    served: ServedModel | None  # the vLLM endpoint used (to tokenize), if one was
    warnings: list[str]


def served_model(body: PinIn, node: Node, http: httpx.Client) -> ServedModel:
    """The configured endpoint serving `body.served_model` (the first one's first model when unnamed)."""
    return find_served(http, node.settings.vllm_urls, body.served_model, timeout_s=TOKENIZE_TIMEOUT_S)


def _check_served(namespace: Namespace, served: ServedModel) -> None:
    # The namespace's model name is the engine's `--model`, which vLLM lists as the served model's root.
    if served.root is not None and served.root != namespace.model_name:
        raise ConfigError(
            f"served model {served.name!r} at {served.base_url} runs {served.root!r}, but namespace "
            f"{namespace.id} is for {namespace.model_name!r}: its tokens would not be this namespace's"
        )


def _tokens(
    body: PinIn, namespace: Namespace, node: Node, http: httpx.Client
) -> tuple[list[int], ServedModel | None]:
    if body.token_ids is not None:
        return body.token_ids, None
    served = served_model(body, node, http)
    _check_served(namespace, served)
    try:
        if body.prompt is not None:
            return tokenize_prompt(http, served, body.prompt, timeout_s=TOKENIZE_TIMEOUT_S), served
        assert body.messages is not None
        tokens = tokenize_messages(
            http,
            served,
            body.messages,
            add_generation_prompt=body.add_generation_prompt,
            timeout_s=TOKENIZE_TIMEOUT_S,
        )
        return tokens, served
    except VLLMError as exc:
        if 400 <= exc.status < 500:  # the engine refused this input (unknown model, a template error, ...)
            raise ConfigError(f"could not tokenize: {exc}") from None
        raise


def prepare(body: PinIn, node: Node, http: httpx.Client, *, what: str) -> Prepared:
    """Namespace, tokens (from the engine when not given), the engines' key scheme and the chunk keys;
    `ConfigError` and friends for what makes the request unanswerable."""
    namespace = _namespace(body, node)
    tokens, served = _tokens(body, namespace, node, http)
    check_limits(namespace, tokens, body, node)
    scheme, warning = check_scheme(node.store, namespace)
    keys = chunk_keys(
        namespace, tokens, blocks_per_chunk=body.blocks_per_chunk, algo=scheme.hash_algo or DEFAULT_HASH_ALGO
    )
    check_cache_keys(keys)
    if not keys:
        raise ConfigError(
            f"{len(tokens)} tokens make no full chunk "
            f"(tokens_per_hash={namespace.tokens_per_hash}); nothing to {what}"
        )
    return Prepared(namespace, tokens, scheme, keys, served, [] if warning is None else [warning])
