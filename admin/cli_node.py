"""The commands about this node: `kvstore fsck` (its NVMe cache), `kvstore stats`, `kvstore warm` and
`kvstore migrate` (its cache index and the bucket layout)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvstore.admin.cli_common import (
    EXIT_CONFIG,
    EXIT_PROBLEMS,
    EXIT_UNAVAILABLE,
    ModelPathOption,
    NamespaceOption,
    PromptOption,
    ServedModelOption,
    TokenIdsOption,
    console,
    err,
    node_or_exit,
    one_source_or_exit,
    prompt_tokens,
    say,
    settings_or_exit,
    store_or_exit,
)
from kvstore.cache import NVMeCache
from kvstore.errors import ConfigError, KVStoreError

__all__ = ["fsck", "migrate", "stats", "warm"]


def fsck(
    fix: Annotated[bool, typer.Option("--fix", help="Repair what is found")] = False,
    cache_dir: Annotated[Path | None, typer.Option(help="Cache directory (default from settings)")] = None,
) -> None:
    """Reconcile the NVMe cache's index with its files: orphans, missing files, bad checksums. With --fix, a
    damaged index is rebuilt from the chunk files (each names its key), and it works on a full disk."""
    from kvstore.cache import rebuild_index

    settings = settings_or_exit(cache_dir=cache_dir)
    try:
        try:
            cache = NVMeCache(settings.cache_dir, settings.cache_bytes, repair=True)
        except KVStoreError as exc:
            if not (fix and "damaged" in str(exc)):
                raise
            rebuilt = rebuild_index(settings.cache_dir)
            err.print(
                f"rebuilt the damaged index from {rebuilt.entries} chunk files "
                f"({rebuilt.skipped_files} unusable files removed); the old index is in {rebuilt.kept_aside}",
                markup=False,
            )
            cache = NVMeCache(settings.cache_dir, settings.cache_bytes, repair=True)
        with cache:
            report = cache.fsck(fix=fix)
    except KVStoreError as exc:
        say("cannot open cache", exc)
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    console.print_json(json.dumps(report.as_dict()))
    if not report.clean and not fix:
        raise typer.Exit(EXIT_PROBLEMS)


def stats(
    scan_bucket: Annotated[bool, typer.Option(help="Count the bucket's chunk objects (lists it)")] = True,
) -> None:
    """Per-tier usage and hit rates, NVMe usage, bucket size, pins and the last GC of this node."""
    from kvstore.stats import node_stats
    from kvstore.storage import store_and_cache

    try:
        with store_and_cache(settings_or_exit()) as parts:  # read-only: no engine, none of its threads
            console.print_json(json.dumps(node_stats(parts, scan_bucket=scan_bucket), default=str))
    except ConfigError as exc:
        say("cannot open the node", exc)
        raise typer.Exit(EXIT_CONFIG) from None
    except KVStoreError as exc:
        say("cannot open the node", exc)
        raise typer.Exit(EXIT_UNAVAILABLE) from None


def warm(
    namespace: NamespaceOption,
    token_ids: TokenIdsOption = None,
    prompt: PromptOption = None,
    model_path: ModelPathOption = None,
    vllm_url: Annotated[
        str | None,
        typer.Option(help="vLLM endpoint that tokenizes and produces missing chunks (default: vllm_urls)"),
    ] = None,
    model: ServedModelOption = None,
    pin: Annotated[str | None, typer.Option(help="Also pin the chunks under this name")] = None,
) -> None:
    """Prefetch a prompt's chunks into this node's NVMe cache; have vLLM produce the missing ones."""
    from kvstore.warm import warm as run_warm

    one_source_or_exit(prompt, token_ids)
    settings = settings_or_exit()
    urls = [vllm_url] if vllm_url else settings.vllm_urls
    node = node_or_exit(settings, "cannot open the node")
    try:
        tokens = prompt_tokens(
            token_ids=token_ids, prompt=prompt, model_path=model_path, urls=urls, served_model=model
        )
        report = run_warm(node, namespace, tokens, vllm_urls=urls, model=model, pin=pin)
    except (ValueError, ConfigError) as exc:
        say("bad arguments", exc)
        raise typer.Exit(EXIT_CONFIG) from None
    except KVStoreError as exc:
        say("warm failed", exc)
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    finally:
        node.close()
    console.print_json(json.dumps(report.as_dict()))
    if report.still_missing:
        raise typer.Exit(EXIT_PROBLEMS)


def migrate() -> None:
    """Apply the numbered migrations to this node's cache index and to the bucket layout."""
    from kvstore.migrations.runner import migrate as run_migrations

    settings = settings_or_exit()
    with store_or_exit(settings, "migration failed") as store:
        applied = run_migrations(cache_dir=settings.cache_dir, store=store)
    for step in applied:
        console.print(f"applied {step.target} migration {step.version}: {step.describe}", markup=False)
    if not applied:
        console.print("nothing to migrate: cache index and bucket are up to date")
