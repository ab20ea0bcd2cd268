"""The few calls the fleet tools make to a vLLM OpenAI server: its models, `/tokenize`, one prefill.

Pins and warming must hash exactly the tokens the engine will hash, so prompts and chat messages are
tokenized by the serving engine itself (`POST /tokenize`, which applies the served model's chat template to
messages), not by a tokenizer read from some path. Which servers may be called is the operator's choice (the
`vllm_urls` setting, or a CLI option); a request only names a served model, and `find_served` picks the
configured endpoint that serves it. Answers from a server are never copied into results: an error names the
URL and the HTTP status; what the server said goes to this process's log.

Speaks HTTP (httpx); imports neither vLLM nor torch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvstore.errors import ConfigError, KVStoreError

__all__ = [
    "ServedModel",
    "VLLMError",
    "VLLMUnreachable",
    "find_served",
    "list_models",
    "request_prefill",
    "tokenize_messages",
    "tokenize_prompt",
    "tokenize_with",
]

log = logging.getLogger(__name__)

# A vLLM that accepts no TCP connection this long is unreachable, whatever the call's own timeout allows.
_CONNECT_TIMEOUT_S = 10.0
_LOGGED_ANSWER_CHARS = 300


class VLLMUnreachable(KVStoreError):
    """No vLLM server answered at the URL (connection refused, DNS, timeout)."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"vLLM at {url} is unreachable: {reason}")
        self.url = url


class VLLMError(KVStoreError):
    """The vLLM server answered, but not with what was asked (bad model name, prompt too long, ...)."""

    def __init__(self, url: str, status: int, detail: str) -> None:
        super().__init__(f"vLLM at {url} answered {status}: {detail}")
        self.url = url
        self.status = status


@dataclass(frozen=True)
class ServedModel:
    """One model a vLLM server serves: where, under which name, and what it runs (`root`, the `--model`
    argument, which is also the namespace's model name)."""

    base_url: str
    name: str
    root: str | None = None
    max_model_len: int | None = None


def _base(url: str) -> str:
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ConfigError(f"vLLM URL must start with http:// or https://, got {url!r}")
    return base


def _call(
    http: httpx.Client, method: str, base: str, path: str, body: Mapping[str, Any] | None, timeout_s: float
) -> Any:
    try:
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, _CONNECT_TIMEOUT_S))
        response = http.request(method, f"{base}{path}", json=body, timeout=timeout)
    except httpx.TransportError as exc:  # connect errors, timeouts, protocol errors
        raise VLLMUnreachable(base, f"{type(exc).__name__}: {exc}") from None
    if response.status_code >= 400:
        log.warning(
            "vLLM at %s answered %s %s with %d: %s",
            base,
            method,
            path,
            response.status_code,
            response.text[:_LOGGED_ANSWER_CHARS],
        )
        raise VLLMError(base, response.status_code, f"{method} {path} failed ({response.reason_phrase})")
    try:
        return response.json()
    except ValueError:
        raise VLLMError(base, response.status_code, f"{method} {path}: the answer is not JSON") from None


def list_models(http: httpx.Client, url: str, *, timeout_s: float = 30.0) -> list[ServedModel]:
    """`GET /v1/models` of one server."""
    base = _base(url)
    listing = _call(http, "GET", base, "/v1/models", None, timeout_s)
    try:
        return [
            ServedModel(
                base,
                str(entry["id"]),
                None if entry.get("root") is None else str(entry["root"]),
                entry.get("max_model_len") if isinstance(entry.get("max_model_len"), int) else None,
            )
            for entry in listing["data"]
        ]
    except (KeyError, TypeError, AttributeError):
        raise VLLMError(base, 200, "GET /v1/models: not a model listing") from None


def find_served(
    http: httpx.Client, urls: Sequence[str], name: str | None = None, *, timeout_s: float = 30.0
) -> ServedModel:
    """The first configured endpoint serving the model named `name` (any model when None). `ConfigError`
    when none is configured or none serves it; unreachable endpoints are skipped unless all are."""
    if not urls:
        raise ConfigError(
            "no vLLM endpoint is configured (the vllm_urls setting): tokenizing a prompt and producing "
            "missing chunks need one"
        )
    unreachable: list[KVStoreError] = []
    for url in urls:
        try:
            models = list_models(http, url, timeout_s=timeout_s)
        except (VLLMUnreachable, VLLMError) as exc:
            unreachable.append(exc)
            continue
        for served in models:
            if name is None or served.name == name:
                return served
    if unreachable and len(unreachable) == len(urls):
        raise unreachable[0]
    wanted = "any model" if name is None else f"a model named {name!r}"
    raise ConfigError(f"none of the configured vLLM endpoints serves {wanted}")


def _tokens(answer: Any, base: str) -> list[int]:
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    plain = isinstance(tokens, list) and all(type(t) is int for t in tokens)  # bools are ints too
    if not plain:
        raise VLLMError(base, 200, "POST /tokenize: the answer holds no token ids")
    assert isinstance(tokens, list)
    return tokens


def tokenize_prompt(
    http: httpx.Client,
    served: ServedModel,
    prompt: str,
    *,
    add_special_tokens: bool = True,
    timeout_s: float = 30.0,
) -> list[int]:
    """The token ids the server's completions endpoint makes of `prompt` (special tokens added, as there)."""
    body = {"model": served.name, "prompt": prompt, "add_special_tokens": add_special_tokens}
    return _tokens(_call(http, "POST", served.base_url, "/tokenize", body, timeout_s), served.base_url)


def tokenize_messages(
    http: httpx.Client,
    served: ServedModel,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    timeout_s: float = 30.0,
) -> list[int]:
    """The token ids of chat messages rendered with the served model's chat template, as its chat endpoint
    renders them. For a pin, pass the shared head of the conversation (the system message) and no generation
    prompt: its full chunks are the prefix every later conversation starts with."""
    body = {
        "model": served.name,
        "messages": [dict(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        "add_special_tokens": False,  # the rendered template carries its own
    }
    return _tokens(_call(http, "POST", served.base_url, "/tokenize", body, timeout_s), served.base_url)


def request_prefill(
    http: httpx.Client, served: ServedModel, token_ids: Sequence[int], *, timeout_s: float = 120.0
) -> None:
    """Have the server process `token_ids` once (a completion of `max_tokens=1`, greedy): an engine running
    our tier stores the prompt's KV on the way."""
    body = {"model": served.name, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0}
    _call(http, "POST", served.base_url, "/v1/completions", body, timeout_s)


def tokenize_with(
    urls: Sequence[str], prompt: str, *, served_model: str | None = None, timeout_s: float = 30.0
) -> tuple[list[int], ServedModel]:
    """`tokenize_prompt` on the first of `urls` serving `served_model` (any model when None), for tools that
    have no client of their own (the CLI)."""
    with httpx.Client(timeout=timeout_s) as http:
        served = find_served(http, urls, served_model, timeout_s=timeout_s)
        return tokenize_prompt(http, served, prompt, timeout_s=timeout_s), served
