"""The `kvstore` command as a user runs it: the embedded default, fsck exit codes, configuration errors."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.cache import NVMeCache
from tests.cache_helpers import admit, locate, read_chunk
from tests.helpers import cli_env, free_port, listed_older_than

KVSTORE = [sys.executable, "-m", "kvstore.admin.cli"]


pytestmark = pytest.mark.slow


def test_serve_starts_the_embedded_s3_server_and_stops_it(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [*KVSTORE, "serve", "--port", str(port)],
        env=cli_env(tmp_path, KVSTORE_ADMIN_TOKEN="tok"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        health = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.3)
        assert health is not None and health.status_code == 200, "serve did not come up"
        assert health.json()["store"]["ok"]
        creds = tmp_path / "data" / "kvstore" / "s3" / "credentials.json"
        assert creds.stat().st_mode & 0o777 == 0o600
        # The /v1 API over HTTP, on the served instance and its real S3 server.
        base = f"http://127.0.0.1:{port}/v1"
        assert httpx.get(f"{base}/pins", timeout=10).status_code == 401
        auth = {"Authorization": "Bearer tok"}
        assert (
            httpx.get(f"{base}/pins", headers={"Authorization": "Bearer no"}, timeout=10).status_code == 403
        )
        assert httpx.get(f"{base}/pins", headers=auth, timeout=10).json() == {"pins": []}
        gc = httpx.post(f"{base}/gc", json={"ttl_seconds": 60, "dry_run": True}, headers=auth, timeout=10)
        assert gc.status_code == 202
        bad = httpx.post(f"{base}/gc", json={"ttl_seconds": "soon"}, headers=auth, timeout=10)
        assert bad.status_code == 422 and bad.json()["detail"]
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert "embedded S3 server: http://127.0.0.1:" in out
    secret = json.loads(creds.read_text())["secret_key"]
    assert secret not in out
    # Nothing left listening: the embedded server went down with the service.
    weeds = subprocess.run(["pgrep", "-f", str(tmp_path / "data")], capture_output=True, text=True).stdout
    assert weeds.strip() == ""


def test_fsck_exit_codes(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    with NVMeCache(cache_dir, 1 << 20) as cache:
        admit(cache, "a/1.bin", b"x" * 5000)
        located = locate(cache, "a/1.bin")
        assert located is not None
    with open(located.path, "r+b") as f:
        f.seek(4096)  # the payload's first byte
        f.write(b"y")
    env = cli_env(tmp_path, KVSTORE_CACHE_DIR=str(cache_dir), KVSTORE_CACHE_BYTES=str(1 << 20))
    check = subprocess.run([*KVSTORE, "fsck"], env=env, capture_output=True, text=True)
    assert check.returncode == 1, check.stdout + check.stderr
    fix = subprocess.run([*KVSTORE, "fsck", "--fix"], env=env, capture_output=True, text=True)
    assert fix.returncode == 0, fix.stdout + fix.stderr
    again = subprocess.run([*KVSTORE, "fsck"], env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr


def test_fsck_refuses_a_damaged_index_and_fix_rebuilds_it(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    with NVMeCache(cache_dir, 1 << 20) as cache:
        for i in range(5):
            admit(cache, f"a/{i}.bin", bytes([i]) * 5000)
    os.truncate(cache_dir / "index" / "data.mdb", 8192)
    env = cli_env(tmp_path, KVSTORE_CACHE_DIR=str(cache_dir), KVSTORE_CACHE_BYTES=str(1 << 20))
    check = subprocess.run([*KVSTORE, "fsck"], env=env, capture_output=True, text=True)
    assert check.returncode == 3, check.stdout + check.stderr  # not a SIGBUS (135), not a traceback
    assert "damaged" in check.stderr and "fsck --fix" in check.stderr
    fix = subprocess.run([*KVSTORE, "fsck", "--fix"], env=env, capture_output=True, text=True)
    assert fix.returncode == 0, fix.stdout + fix.stderr
    assert "rebuilt the damaged index from 5 chunk files" in fix.stderr
    with NVMeCache(cache_dir, 1 << 20) as cache:
        assert [read_chunk(cache, f"a/{i}.bin") for i in range(5)] == [bytes([i]) * 5000 for i in range(5)]


def test_fsck_fix_runs_on_a_full_disk(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        cache_dir = mount / "cache"
        with NVMeCache(cache_dir, 1 << 20) as cache:
            admit(cache, "a/1.bin", b"x" * 5000)
        folder = next((cache_dir / "chunks").iterdir())
        leftover = folder / ".1.deadbeef.0011223344556677.tmp"  # a killed writer's partial file
        leftover.write_bytes(b"y" * 100_000)
        with open(mount / "filler", "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
        env = cli_env(tmp_path, KVSTORE_CACHE_DIR=str(cache_dir), KVSTORE_CACHE_BYTES=str(1 << 20))
        fix = subprocess.run([*KVSTORE, "fsck", "--fix"], env=env, capture_output=True, text=True)
        assert fix.returncode == 0, fix.stdout + fix.stderr
        assert not leftover.exists()
        assert json.loads(fix.stdout)["orphan_files"] == [str(leftover.relative_to(cache_dir))]
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_bad_configuration_exits_2_and_names_the_option(tmp_path: Path) -> None:
    env = cli_env(tmp_path, KVSTORE_CACHE_BYTES="-1")
    result = subprocess.run([*KVSTORE, "fsck"], env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert "cache_bytes" in result.stderr


def test_gc_from_cron_reports_and_respects_the_lease(tmp_path: Path, s3_server: Any, s3_store: Any) -> None:
    from kvstore.lease import Lease

    for i in range(3):
        s3_store.put(f"ns_r0/abc/de_g0/{i:064x}.bin", b"z" * 100)  # GC never reads a chunk
    env = cli_env(
        tmp_path,
        KVSTORE_STORE_URL=f"s3://{s3_store.bucket}/{s3_store.prefix}",
        KVSTORE_S3_ENDPOINT=s3_server.endpoint,
        AWS_ACCESS_KEY_ID=s3_server.access_key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
    )
    dry = subprocess.run(
        [*KVSTORE, "gc", "--dry-run", "--ttl-seconds", "60"], env=env, capture_output=True, text=True
    )
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert report["objects"] == 3 and report["dry_run"] and report["deleted"] == 0
    with Lease(s3_store, ttl_s=60, holder="someone-else"):
        busy = subprocess.run(
            [*KVSTORE, "gc", "--ttl-seconds", "60"], env=env, capture_output=True, text=True
        )
    assert busy.returncode == 4, busy.stdout + busy.stderr
    assert "another GC is running" in busy.stderr


def test_pin_add_ls_rm_and_migrate(tmp_path: Path, s3_server: Any, s3_store: Any) -> None:
    from kvstore.keys import Namespace
    from kvstore.pins import get_pin

    ns = Namespace(model_name="tiny/model", tokens_per_hash=4, dtype="torch.bfloat16")
    s3_store.put(ns.config_key, json.dumps(ns.fields()).encode())
    env = cli_env(
        tmp_path,
        KVSTORE_STORE_URL=f"s3://{s3_store.bucket}/{s3_store.prefix}",
        KVSTORE_S3_ENDPOINT=s3_server.endpoint,
        KVSTORE_CACHE_DIR=str(tmp_path / "cache"),
        AWS_ACCESS_KEY_ID=s3_server.access_key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
    )
    tokens = ",".join(str(t) for t in range(10))
    add = subprocess.run(
        [*KVSTORE, "pin", "add", "system", "--namespace", ns.id, "--token-ids", tokens],
        env=env,
        capture_output=True,
        text=True,
    )
    assert add.returncode == 0, add.stdout + add.stderr
    assert len(get_pin(s3_store, "system").keys) == 2  # two full chunks of 4 tokens
    listing = subprocess.run([*KVSTORE, "pin", "ls"], env=env, capture_output=True, text=True)
    assert listing.returncode == 0 and "system" in listing.stdout
    assert subprocess.run([*KVSTORE, "pin", "rm", "system"], env=env, capture_output=True).returncode == 0
    assert subprocess.run([*KVSTORE, "pin", "rm", "system"], env=env, capture_output=True).returncode == 1
    bad = subprocess.run(
        [*KVSTORE, "pin", "add", "x", "--namespace", ns.id], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2

    stats = subprocess.run([*KVSTORE, "stats"], env=env, capture_output=True, text=True)
    assert stats.returncode == 0, stats.stdout + stats.stderr
    assert json.loads(stats.stdout)["bucket"]["chunk_objects"] == 0
    # Nothing stored and no vLLM endpoint to produce the chunks: warm reports them missing, exit 1.
    warm = subprocess.run(
        [*KVSTORE, "warm", "--namespace", ns.id, "--token-ids", tokens],
        env=env,
        capture_output=True,
        text=True,
    )
    assert warm.returncode == 1, warm.stdout + warm.stderr
    assert json.loads(warm.stdout)["still_missing"] == 2

    first = subprocess.run([*KVSTORE, "migrate"], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stdout + first.stderr
    again = subprocess.run([*KVSTORE, "migrate"], env=env, capture_output=True, text=True)
    assert again.returncode == 0 and "nothing to migrate" in again.stdout


def test_gc_from_cron_publishes_block_removed(
    tmp_path: Path, s3_server: Any, s3_store: Any, kv_subscriber: Any
) -> None:
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    from kvstore.keys import Namespace, make_offload_key

    ns = Namespace(model_name="tiny/model", tokens_per_hash=4, dtype="torch.bfloat16")
    hashes = [bytes([i]) * 32 for i in range(3)]
    for h in hashes:
        s3_store.put(ns.chunk_key(make_offload_key(h)), b"z" * 100)  # GC never reads a chunk
    env = cli_env(
        tmp_path,
        KVSTORE_STORE_URL=f"s3://{s3_store.bucket}/{s3_store.prefix}",
        KVSTORE_S3_ENDPOINT=s3_server.endpoint,
        KVSTORE_EVENTS_ENDPOINT=kv_subscriber.endpoint,
        AWS_ACCESS_KEY_ID=s3_server.access_key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
    )
    listed_older_than(s3_store, [ns.chunk_key(make_offload_key(h)) for h in hashes], 1.0)  # past grace 0
    args = [*KVSTORE, "gc", "--ttl-seconds", "0", "--grace-seconds", "0"]
    dry = subprocess.run([*args, "--dry-run"], env=env, capture_output=True, text=True)
    assert dry.returncode == 0 and json.loads(dry.stdout)["deleted"] == 3, dry.stderr
    run = subprocess.run(args, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["deleted"] == 3
    # The process is gone; its one batch arrived (the dry run sent none: this is the first, seq 0).
    _, seq, batch = kv_subscriber.next()
    assert seq == 0 and len(batch.events) == 1
    expected = {maybe_convert_block_hash(BlockHash(h)) for h in hashes}
    assert set(batch.events[0].block_hashes) == expected

    bad = subprocess.run(
        args, env={**env, "KVSTORE_EVENTS_ENDPOINT": "udp://x"}, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "events_endpoint" in bad.stderr


# (`kvstore stats` reports an unreachable store in its JSON and exits 0: tests/kvstore/test_stats.py.)
@pytest.mark.parametrize("args", [["gc", "--dry-run"], ["pin", "ls"], ["pin", "rm", "x"]])
def test_an_unreachable_store_exits_3_with_a_message(tmp_path: Path, args: list[str]) -> None:
    env = cli_env(
        tmp_path,
        KVSTORE_STORE_URL="s3://bucket/prefix",
        KVSTORE_S3_ENDPOINT=f"http://127.0.0.1:{free_port()}",  # nobody listens there
        KVSTORE_CACHE_DIR=str(tmp_path / "cache"),
        AWS_ACCESS_KEY_ID="AK",
        AWS_SECRET_ACCESS_KEY="not-shown",
    )
    result = subprocess.run([*KVSTORE, *args], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "127.0.0.1" in result.stderr
    assert "not-shown" not in result.stdout + result.stderr
