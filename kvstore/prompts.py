"""Token ids of a prompt or chat messages from a model directory, as vLLM's completions and chat endpoints
tokenize them: the model's `tokenizer.json`, and its chat template rendered in the sandboxed Jinja environment
HF templates expect. For the CLI's `--model-path` and the tests; the admin service tokenizes through the
engine itself (`kvstore.vllm_api`). Imports `tokenizers` and `jinja2` lazily, never `transformers` (which
would pull in torch)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError

__all__ = ["render_chat", "tokens_from_messages", "tokens_from_prompt"]


def tokens_from_prompt(
    model_path: str | os.PathLike[str], prompt: str, *, add_special_tokens: bool = True
) -> list[int]:
    """Token ids of a completion prompt, as vLLM's completions endpoint tokenizes it (special tokens added by
    the tokenizer's own post-processor)."""
    return list(_tokenizer(model_path).encode(prompt, add_special_tokens=add_special_tokens).ids)


def tokens_from_messages(
    model_path: str | os.PathLike[str],
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
) -> list[int]:
    """Token ids of chat messages rendered with the model's chat template, as vLLM's chat endpoint does.

    For a pin, pass only the shared head of the conversation (the system message): its full chunks are the
    prefix every later conversation starts with. The rendered text carries its own special tokens, so it is
    tokenized without adding more."""
    text = render_chat(model_path, messages, add_generation_prompt=add_generation_prompt)
    return list(_tokenizer(model_path).encode(text, add_special_tokens=False).ids)


@dataclass(frozen=True)
class _ChatTemplate:
    source: str
    special: Mapping[str, str] = field(default_factory=dict)


def _chat_template(model_path: Path) -> _ChatTemplate:
    try:
        config = json.loads((model_path / "tokenizer_config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
        template = config.get("chat_template")
        if template is None and (model_path / "chat_template.jinja").exists():
            template = (model_path / "chat_template.jinja").read_text()
    except FileNotFoundError:
        raise ConfigError(f"{model_path} has no tokenizer_config.json") from None
    except (OSError, ValueError) as exc:  # unreadable, not a directory, not JSON, not UTF-8
        raise ConfigError(f"{model_path}: cannot read the chat template: {exc}") from None
    if isinstance(template, list):  # named templates: the HF convention picks "default"
        named = (t for t in template if isinstance(t, dict) and t.get("name") == "default")
        template = next((t.get("template") for t in named), None)
    if not isinstance(template, str):
        raise ConfigError(f"{model_path} defines no chat template")
    special: dict[str, str] = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            special[name] = value
    return _ChatTemplate(template, special)


def render_chat(
    model_path: str | os.PathLike[str],
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
) -> str:
    """The chat template applied to `messages`, in the sandboxed Jinja environment HF templates expect."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tpl = _chat_template(Path(model_path))

    def raise_exception(message: str) -> None:
        raise ConfigError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(tpl.source).render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **tpl.special
        )
    except ConfigError:
        raise
    # A template is a program over the caller's messages: what it raises means the messages don't fit it.
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
        raise ConfigError(f"chat template failed to render: {type(exc).__name__}: {exc}") from None


def _tokenizer(model_path: str | os.PathLike[str]) -> Any:
    from tokenizers import Tokenizer

    path = Path(model_path) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{model_path} has no tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{model_path}: cannot read tokenizer.json: {exc}") from None
    except Exception as exc:  # tokenizers raises plain `Exception` for a malformed file
        raise ConfigError(f"{model_path}: tokenizer.json is not a tokenizer: {exc}") from None
