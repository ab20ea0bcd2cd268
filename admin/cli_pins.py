"""`kvstore pin add|ls|rm`: pin manifests in the bucket, whose chunks nodes and GC keep."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from kvstore.admin.cli_common import (
    EXIT_CONFIG,
    EXIT_PROBLEMS,
    console,
    finite_seconds,
    say,
    settings_or_exit,
    store_or_exit,
)
from kvstore.errors import ConfigError

__all__ = ["pin_app"]

pin_app = typer.Typer(
    no_args_is_help=True, help="Pin manifests in the bucket: nodes and GC keep their chunks."
)


@pin_app.command("add")
def pin_add(
    name: Annotated[str, typer.Argument(help="Pin name ([A-Za-z0-9._-], up to 128)")],
    namespace: Annotated[str, typer.Option(help="Namespace id (<model>_<sha12>, as in the bucket)")],
    prompt: Annotated[
        str | None, typer.Option(help="Prompt text, tokenized by the vLLM endpoint (or --model-path)")
    ] = None,
    token_ids: Annotated[str | None, typer.Option(help="Comma-separated token ids")] = None,
    vllm_url: Annotated[
        str | None, typer.Option(help="vLLM endpoint that tokenizes --prompt (default: first of vllm_urls)")
    ] = None,
    served_model: Annotated[
        str | None, typer.Option(help="Served model name at that endpoint (default: its first)")
    ] = None,
    model_path: Annotated[
        Path | None, typer.Option(help="Tokenize --prompt with this model dir's tokenizer.json instead")
    ] = None,
    ttl_seconds: Annotated[float | None, typer.Option(help="Expire the pin after this long")] = None,
) -> None:
    """Pin the chunks of a prompt (e.g. a system prompt) or of token ids, hashed like the namespace's
    engines (a seed none of them uses is refused); says how many of the chunks the bucket holds now."""
    from kvstore.hashing import DEFAULT_HASH_ALGO, chunk_keys
    from kvstore.key_scheme import check_scheme
    from kvstore.pins import create_pin, load_namespace, present_chunks
    from kvstore.prompts import tokens_from_prompt
    from kvstore.vllm_api import tokenize_with

    if (prompt is None) == (token_ids is None):
        say("give exactly one of --prompt or --token-ids")
        raise typer.Exit(EXIT_CONFIG)
    finite_seconds("--ttl-seconds", ttl_seconds, positive=True)
    settings = settings_or_exit()
    with store_or_exit(settings, "cannot pin") as store:
        try:
            ns = load_namespace(store, namespace)
            scheme, warning = check_scheme(store, ns)
            if token_ids is not None:
                tokens = [int(t) for t in token_ids.split(",") if t.strip()]
            elif model_path is not None:
                assert prompt is not None
                tokens = tokens_from_prompt(model_path, prompt)
            else:
                assert prompt is not None
                urls = [vllm_url] if vllm_url else settings.vllm_urls
                tokens, _ = tokenize_with(urls, prompt, served_model=served_model)
            keys = chunk_keys(ns, tokens, algo=scheme.hash_algo or DEFAULT_HASH_ALGO)
            manifest = create_pin(store, name, ns, keys, ttl_seconds=ttl_seconds)
            present = present_chunks(store, manifest.keys)
        except (ValueError, ConfigError) as exc:
            say("cannot pin", exc)
            raise typer.Exit(EXIT_CONFIG) from None
    if warning is not None:
        say("warning", warning, style="yellow")
    console.print(
        f"pinned {len(manifest.keys)} chunks as {manifest.name!r}; {present} of them are in the bucket now",
        markup=False,
    )


@pin_app.command("ls")
def pin_ls() -> None:
    """List pin manifests, with how many of each one's chunks the bucket holds."""
    from kvstore.pins import list_pins, present_chunks

    with store_or_exit(settings_or_exit(), "cannot list pins") as store:
        pins = list_pins(store)
        present = [present_chunks(store, pin.keys) for pin in pins]
    table = Table(title="pins")
    for col in ("name", "namespace", "chunks", "in bucket", "expires"):
        table.add_column(col, overflow="fold")
    for pin, found in zip(pins, present, strict=True):
        cells = (pin.name, pin.namespace, str(len(pin.keys)), str(found), str(pin.expires_at or "never"))
        table.add_row(*(Text(cell) for cell in cells))  # as they are, never as markup
    console.print(table)


@pin_app.command("rm")
def pin_rm(name: Annotated[str, typer.Argument(help="Pin name")]) -> None:
    """Delete a pin manifest (its chunks become ordinary cache entries again)."""
    from kvstore.pins import PinNotFound, delete_pin

    with store_or_exit(settings_or_exit(), "cannot delete pin") as store:
        try:
            delete_pin(store, name)
        except PinNotFound as exc:
            say(str(exc))
            raise typer.Exit(EXIT_PROBLEMS) from None
    console.print(f"deleted pin {name!r}", markup=False)
