"""The `kvstore` command line. Every command calls the same library functions as the admin API.

Exit codes are `cli_common`'s; the benchmarks' commands are `kvstore.connector.bench.cli`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvstore.admin.cli_common import (
    EXIT_BUSY,
    EXIT_CONFIG,
    EXIT_PROBLEMS,
    EXIT_UNAVAILABLE,
    console,
    err,
    finite_seconds,
    node_or_exit,
    settings_or_exit,
    store_or_exit,
)
from kvstore.cache import NVMeCache
from kvstore.connector.bench.cli import bench_app
from kvstore.errors import ConfigError, KVStoreError

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Object-storage-first KV cache for vLLM.")
app.add_typer(bench_app, name="bench")
pin_app = typer.Typer(
    no_args_is_help=True, help="Pin manifests in the bucket: nodes and GC keep their chunks."
)
app.add_typer(pin_app, name="pin")


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="Port, 1-65535 (default 8750)")] = None,
    insecure_no_auth: Annotated[
        bool,
        typer.Option(
            "--insecure-no-auth",
            help="Serve /v1 without a token on a non-loopback address: anyone who reaches it can run GC",
        ),
    ] = False,
) -> None:
    """Run the admin service (health, metrics). Starts a local S3 server if none is configured."""
    import uvicorn

    from kvstore.admin.app import create_app
    from kvstore.admin.auth import is_loopback

    settings = settings_or_exit(admin_host=host, admin_port=port)
    if settings.admin_token is None and not is_loopback(settings.admin_host):
        if not insecure_no_auth:
            err.print(
                f"[red]refusing to serve the admin API on {settings.admin_host!r} without a token:[/red] "
                "anyone who reaches it could pin, warm and garbage-collect. Set KVSTORE_ADMIN_TOKEN, bind to "
                "127.0.0.1, or pass --insecure-no-auth if something else guards the network."
            )
            raise typer.Exit(EXIT_CONFIG)
        err.print(
            f"[yellow]warning:[/yellow] the /v1 API on {settings.admin_host!r} accepts requests from anyone "
            "(--insecure-no-auth)"
        )
    node = node_or_exit(settings, "cannot start")
    try:
        if node.embedded is not None:
            console.print(
                f"embedded S3 server: [bold]{node.embedded.endpoint}[/bold] "
                f"(bucket kvstore, data in {settings.data_dir / 's3'}, "
                f"credentials in {settings.data_dir / 's3' / 'credentials.json'})"
            )
        console.print(f"NVMe cache: {settings.cache_dir} (budget {settings.cache_bytes:,} bytes)")
        console.print(
            f"admin API: http://{settings.admin_host}:{settings.admin_port}  (/healthz, /metrics, /docs)"
        )
        uvicorn.run(create_app(node), host=settings.admin_host, port=settings.admin_port, log_level="warning")
    finally:
        node.close()


@app.command()
def demo(
    conversations: Annotated[int, typer.Option(min=1, help="Conversations in the replay")] = 6,
    turns: Annotated[int, typer.Option(min=2, help="Turns per conversation")] = 3,
    hold: Annotated[bool, typer.Option(help="Keep everything running after the report, until Ctrl-C")] = True,
) -> None:
    """Start S3 (embedded), the admin service and vLLM with our tier; replay a multi-turn chat; report."""
    from kvstore.connector.demo.view import show_demo
    from kvstore.connector.harness.vllm_server import VLLMServerError

    try:
        show_demo(settings_or_exit(), console, conversations=conversations, turns=turns, hold=hold)
    except (KVStoreError, VLLMServerError) as exc:
        err.print(f"[red]demo failed:[/red] {exc}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None


@app.command()
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
                f"({rebuilt.skipped_files} unusable files removed); the old index is in {rebuilt.kept_aside}"
            )
            cache = NVMeCache(settings.cache_dir, settings.cache_bytes, repair=True)
        with cache:
            report = cache.fsck(fix=fix)
    except KVStoreError as exc:
        err.print(f"[red]cannot open cache:[/red] {exc}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    console.print_json(json.dumps(report.as_dict()))
    if not report.clean and not fix:
        raise typer.Exit(EXIT_PROBLEMS)


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
        err.print("[red]give exactly one of --prompt or --token-ids[/red]")
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
            err.print(f"[red]cannot pin:[/red] {exc}")
            raise typer.Exit(EXIT_CONFIG) from None
    if warning is not None:
        err.print(f"[yellow]warning:[/yellow] {warning}")
    console.print(
        f"pinned {len(manifest.keys)} chunks as {manifest.name!r}; {present} of them are in the bucket now"
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
        table.add_row(pin.name, pin.namespace, str(len(pin.keys)), str(found), str(pin.expires_at or "never"))
    console.print(table)


@pin_app.command("rm")
def pin_rm(name: Annotated[str, typer.Argument(help="Pin name")]) -> None:
    """Delete a pin manifest (its chunks become ordinary cache entries again)."""
    from kvstore.pins import PinNotFound, delete_pin

    with store_or_exit(settings_or_exit(), "cannot delete pin") as store:
        try:
            delete_pin(store, name)
        except PinNotFound as exc:
            err.print(f"[red]{exc}[/red]")
            raise typer.Exit(EXIT_PROBLEMS) from None
    console.print(f"deleted pin {name!r}")


@app.command()
def stats(
    scan_bucket: Annotated[bool, typer.Option(help="Count the bucket's chunk objects (lists it)")] = True,
) -> None:
    """Per-tier usage and hit rates, NVMe usage, bucket size, pins and the last GC of this node."""
    from kvstore.runtime import store_and_cache
    from kvstore.stats import node_stats

    try:
        with store_and_cache(settings_or_exit()) as parts:  # read-only: no engine, none of its threads
            console.print_json(json.dumps(node_stats(parts, scan_bucket=scan_bucket), default=str))
    except ConfigError as exc:
        err.print(f"[red]cannot open the node:[/red] {exc}")
        raise typer.Exit(EXIT_CONFIG) from None
    except KVStoreError as exc:
        err.print(f"[red]cannot open the node:[/red] {exc}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None


@app.command()
def warm(
    namespace: Annotated[str, typer.Option(help="Namespace id (<model>_<sha12>, as in the bucket)")],
    token_ids: Annotated[str | None, typer.Option(help="Comma-separated token ids")] = None,
    prompt: Annotated[
        str | None, typer.Option(help="Prompt text, tokenized by the vLLM endpoint (or --model-path)")
    ] = None,
    model_path: Annotated[
        Path | None, typer.Option(help="Tokenize --prompt with this model dir's tokenizer.json instead")
    ] = None,
    vllm_url: Annotated[
        str | None,
        typer.Option(help="vLLM endpoint that tokenizes and produces missing chunks (default: vllm_urls)"),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--served-model", "--model", help="Served model name (default: the first)")
    ] = None,
    pin: Annotated[str | None, typer.Option(help="Also pin the chunks under this name")] = None,
) -> None:
    """Prefetch a prompt's chunks into this node's NVMe cache; have vLLM produce the missing ones."""
    from kvstore.prompts import tokens_from_prompt
    from kvstore.vllm_api import tokenize_with
    from kvstore.warm import warm as run_warm

    if (prompt is None) == (token_ids is None):
        err.print("[red]give exactly one of --prompt or --token-ids[/red]")
        raise typer.Exit(EXIT_CONFIG)
    settings = settings_or_exit()
    urls = [vllm_url] if vllm_url else settings.vllm_urls
    node = node_or_exit(settings, "cannot open the node")
    try:
        if token_ids is not None:
            tokens = [int(t) for t in token_ids.split(",") if t.strip()]
        elif model_path is not None:
            assert prompt is not None
            tokens = tokens_from_prompt(model_path, prompt)
        else:
            assert prompt is not None
            tokens, _ = tokenize_with(urls, prompt, served_model=model)
        report = run_warm(node, namespace, tokens, vllm_urls=urls, model=model, pin=pin)
    except (ValueError, ConfigError) as exc:
        err.print(f"[red]bad arguments:[/red] {exc}")
        raise typer.Exit(EXIT_CONFIG) from None
    except KVStoreError as exc:
        err.print(f"[red]warm failed:[/red] {exc}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    finally:
        node.close()
    console.print_json(json.dumps(report.as_dict()))
    if report.still_missing:
        raise typer.Exit(EXIT_PROBLEMS)


@app.command()
def migrate() -> None:
    """Apply the numbered migrations to this node's cache index and to the bucket layout."""
    from kvstore.migrations.runner import migrate as run_migrations

    settings = settings_or_exit()
    with store_or_exit(settings, "migration failed") as store:
        applied = run_migrations(cache_dir=settings.cache_dir, store=store)
    for step in applied:
        console.print(f"applied {step.target} migration {step.version}: {step.describe}")
    if not applied:
        console.print("nothing to migrate: cache index and bucket are up to date")


@app.command()
def gc(
    ttl_seconds: Annotated[float, typer.Option(help="Delete unpinned chunks idle longer than this")] = 7
    * 86400,
    max_bytes: Annotated[
        int | None, typer.Option(help="Then delete oldest-first down to this many bytes")
    ] = None,
    grace_seconds: Annotated[float, typer.Option(help="Never touch objects younger than this")] = 3600,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Report what would be deleted, delete nothing")
    ] = False,
) -> None:
    """Garbage-collect the bucket (run it from cron): TTL, then a byte budget; pins and young objects stay.
    With `events_endpoint` set, each deleted batch is published as vLLM `BlockRemoved` events."""
    from kvstore.events import open_publisher
    from kvstore.gc import run_gc
    from kvstore.lease import LeaseHeld

    finite_seconds("--ttl-seconds", ttl_seconds)
    finite_seconds("--grace-seconds", grace_seconds)
    if max_bytes is not None and max_bytes < 0:
        err.print(f"[red]bad arguments:[/red] --max-bytes must be >= 0, got {max_bytes}")
        raise typer.Exit(EXIT_CONFIG)
    settings = settings_or_exit()
    try:
        publisher = None if dry_run else open_publisher(settings.events_endpoint)
    except ConfigError as exc:
        err.print(f"[red]configuration error:[/red] {exc}")
        raise typer.Exit(EXIT_CONFIG) from None
    with contextlib.ExitStack() as stack, store_or_exit(settings, "GC failed") as store:
        if publisher is not None:
            stack.callback(publisher.close)  # lingers so the last batch still goes out
        try:
            store.check()
            report = run_gc(
                store,
                ttl_seconds=ttl_seconds,
                max_bytes=max_bytes,
                grace_seconds=grace_seconds,
                dry_run=dry_run,
                # The bucket's pin manifests are read by run_gc itself, and re-read before every delete.
                on_removed=publisher.publish_removed if publisher is not None else None,
            )
        except LeaseHeld as exc:
            err.print(f"[yellow]another GC is running:[/yellow] {exc}")
            raise typer.Exit(EXIT_BUSY) from None
        except ValueError as exc:
            err.print(f"[red]bad arguments:[/red] {exc}")
            raise typer.Exit(EXIT_CONFIG) from None
    console.print_json(json.dumps(report.as_dict()))


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except ConfigError as exc:
        err.print(f"[red]configuration error:[/red] {exc}")
        sys.exit(EXIT_CONFIG)
    except KVStoreError as exc:  # a store or cache failure no command translated itself
        err.print(f"[red]error:[/red] {exc}")
        sys.exit(EXIT_UNAVAILABLE)
    except OSError as exc:  # e.g. a directory on a read-only or full file system: a message, not a traceback
        err.print(f"[red]error:[/red] {exc}")
        sys.exit(EXIT_UNAVAILABLE)


if __name__ == "__main__":
    main()
