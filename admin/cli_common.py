"""What every `kvstore` command shares: the consoles, the exit codes, and settings, stores and nodes opened
with their failures turned into a message and an exit code.

Messages are printed with `say`, which styles only its label: what follows (an error's text, which may quote a
path or a value with rich's `[...]` markup syntax in it) is printed as it is, never read as markup.

Exit codes scripts and cron can rely on: 0 success, 1 a check found problems (fsck), 2 bad usage or
configuration, 3 the store or cache could not be used, 4 another GC holds the lease (try later).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.text import Text

from kvstore.config import Settings, load_settings
from kvstore.errors import ConfigError, KVStoreError
from kvstore.stores import ObjectStore

if TYPE_CHECKING:
    from kvstore.runtime import AgentMode, Node

__all__ = [
    "EXIT_BUSY",
    "EXIT_CONFIG",
    "EXIT_PROBLEMS",
    "EXIT_UNAVAILABLE",
    "ModelPathOption",
    "NamespaceOption",
    "PromptOption",
    "ServedModelOption",
    "TokenIdsOption",
    "VLLMUrlOption",
    "console",
    "err",
    "finite_seconds",
    "node_or_exit",
    "one_source_or_exit",
    "prompt_tokens",
    "say",
    "settings_or_exit",
    "store_or_exit",
]

EXIT_PROBLEMS, EXIT_CONFIG, EXIT_UNAVAILABLE, EXIT_BUSY = 1, 2, 3, 4

# Piped into a file, tables keep whole cells: rich would otherwise fit them to 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)  # messages stay one line (scripts grep them)


def say(label: str, message: object = "", *, style: str = "red") -> None:
    """One line on stderr: `label` in `style`, then `message` as plain text (never parsed as markup)."""
    line = Text(label, style=style)
    if message != "":
        line.append(f": {message}")
    err.print(line)


# -- options shared by the commands that name a prompt's chunks (`kvstore warm`, `kvstore pin add`) ----------

NamespaceOption = Annotated[str, typer.Option(help="Namespace id (<model>_<sha12>, as in the bucket)")]
TokenIdsOption = Annotated[str | None, typer.Option(help="Comma-separated token ids")]
PromptOption = Annotated[
    str | None, typer.Option(help="Prompt text, tokenized by the vLLM endpoint (or --model-path)")
]
ModelPathOption = Annotated[
    Path | None, typer.Option(help="Tokenize --prompt with this model dir's tokenizer.json instead")
]
VLLMUrlOption = Annotated[
    str | None, typer.Option(help="vLLM endpoint that tokenizes --prompt (default: the vllm_urls setting)")
]
ServedModelOption = Annotated[
    str | None,
    typer.Option("--served-model", "--model", help="Served model name at that endpoint (default: its first)"),
]


def one_source_or_exit(prompt: str | None, token_ids: str | None) -> None:
    """Exactly one of --prompt and --token-ids, or exit code 2."""
    if (prompt is None) == (token_ids is None):
        say("give exactly one of --prompt or --token-ids")
        raise typer.Exit(EXIT_CONFIG)


def prompt_tokens(
    *,
    token_ids: str | None,
    prompt: str | None,
    model_path: Path | None,
    urls: Sequence[str],
    served_model: str | None,
) -> list[int]:
    """The token ids the options name: given, or the prompt tokenized by a model directory's tokenizer or by
    the serving engine (the first of `urls` that serves `served_model`). `ValueError` for bad ids."""
    from kvstore.prompts import tokens_from_prompt
    from kvstore.vllm_api import tokenize_with

    if token_ids is not None:
        return [int(t) for t in token_ids.split(",") if t.strip()]
    assert prompt is not None
    if model_path is not None:
        return tokens_from_prompt(model_path, prompt)
    tokens, _ = tokenize_with(list(urls), prompt, served_model=served_model)
    return tokens


def settings_or_exit(**overrides: object) -> Settings:
    try:
        return load_settings(**overrides)
    except ConfigError as exc:
        say("configuration error", exc)
        raise typer.Exit(EXIT_CONFIG) from None


def finite_seconds(option: str, value: float | None, *, positive: bool = False) -> None:
    """Refuse NaN, infinities and negatives (click's ranges let NaN through: every comparison is False)."""
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        say("bad arguments", f"{option} must be a finite number {bound}, got {value}")
        raise typer.Exit(EXIT_CONFIG)


@contextlib.contextmanager
def store_or_exit(settings: Settings, failure: str, *, subprefix: str = "") -> Iterator[ObjectStore]:
    """The configured object store (the embedded one if none), closed on exit; a store error becomes a
    message and exit code 3."""
    from kvstore.storage import open_object_store

    try:
        store, server = open_object_store(settings, subprefix=subprefix)
    except ConfigError as exc:
        say(failure, exc)
        raise typer.Exit(EXIT_CONFIG) from None
    except KVStoreError as exc:
        say(failure, exc)
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    try:
        yield store
    except KVStoreError as exc:
        say(failure, exc)
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    finally:
        store.close()
        if server is not None:
            server.stop()


def node_or_exit(
    settings: Settings, failure: str, *, check_store: bool = True, agent: AgentMode = "none"
) -> Node:
    """`open_node` (a tool hosts no node agent unless asked: `agent`), with a bad configuration as exit code
    2 and an unusable store or cache as 3."""
    from kvstore.runtime import open_node

    try:
        return open_node(settings, check_store=check_store, agent=agent)
    except ConfigError as exc:
        say(failure, exc)
        raise typer.Exit(EXIT_CONFIG) from None
    except KVStoreError as exc:
        say(failure, exc)
        raise typer.Exit(EXIT_UNAVAILABLE) from None
