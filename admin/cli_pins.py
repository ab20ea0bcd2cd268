"""`kvstore pin add|ls|rm`: pin manifests in the bucket, whose chunks nodes and GC keep."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from kvstore.admin.cli_common import (
    EXIT_CONFIG,
    EXIT_PROBLEMS,
    ModelPathOption,
    NamespaceOption,
    PromptOption,
    ServedModelOption,
    TokenIdsOption,
    VLLMUrlOption,
    console,
    finite_seconds,
    one_source_or_exit,
    prompt_tokens,
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
    namespace: NamespaceOption,
    prompt: PromptOption = None,
    token_ids: TokenIdsOption = None,
    vllm_url: VLLMUrlOption = None,
    served_model: ServedModelOption = None,
    model_path: ModelPathOption = None,
    ttl_seconds: Annotated[float | None, typer.Option(help="Expire the pin after this long")] = None,
) -> None:
    """Pin the chunks of a prompt (e.g. a system prompt) or of token ids, hashed like the namespace's
    engines (a seed none of them uses is refused); says how many of the chunks the bucket holds now."""
    from kvstore.hashing import DEFAULT_HASH_ALGO, chunk_keys
    from kvstore.key_scheme import check_scheme
    from kvstore.pins import create_pin, load_namespace, present_chunks

    one_source_or_exit(prompt, token_ids)
    finite_seconds("--ttl-seconds", ttl_seconds, positive=True)
    settings = settings_or_exit()
    with store_or_exit(settings, "cannot pin") as store:
        try:
            ns = load_namespace(store, namespace)
            scheme, warning = check_scheme(store, ns)
            urls = [vllm_url] if vllm_url else settings.vllm_urls
            tokens = prompt_tokens(
                token_ids=token_ids,
                prompt=prompt,
                model_path=model_path,
                urls=urls,
                served_model=served_model,
            )
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
