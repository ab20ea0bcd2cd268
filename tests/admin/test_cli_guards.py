"""What the `kvstore` command refuses, each with a message and exit code 2 (never a traceback): an
unauthenticated admin API on a non-loopback address, out-of-range or non-finite settings and arguments, an
empty store list, a store directory that cannot be created; and the warning for mistyped variables."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import cli_env, free_port

KVSTORE = [sys.executable, "-m", "kvstore.admin.cli"]


pytestmark = pytest.mark.slow


def _run(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVSTORE, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["serve", "--host", "0.0.0.0"], {}),
        (["serve", "--host", "::"], {}),
        (["serve"], {"KVSTORE_ADMIN_HOST": "0.0.0.0"}),
    ],
)
def test_serve_refuses_an_open_admin_api_on_a_public_address(
    tmp_path: Path, args: list[str], env: dict[str, str]
) -> None:
    result = _run([*args, "--port", str(free_port())], cli_env(tmp_path, **env))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "without a token" in result.stderr and "--insecure-no-auth" in result.stderr
    assert "Traceback" not in result.stderr
    # It refused before starting anything: no embedded S3 server was created.
    assert not (tmp_path / "data" / "kvstore" / "s3" / "server.json").exists()


@contextlib.contextmanager
def _serving(args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [*KVSTORE, "serve", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def test_serve_on_a_public_address_with_the_explicit_flag(tmp_path: Path) -> None:
    port = free_port()
    env = cli_env(tmp_path, KVSTORE_STORE_URL=f"file://{tmp_path / 'store'}")
    with _serving(["--host", "0.0.0.0", "--port", str(port), "--insecure-no-auth"], env) as proc:
        deadline = time.monotonic() + 60
        answer = None
        while answer is None and time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                answer = httpx.get(f"http://127.0.0.1:{port}/v1/pins", timeout=2)
            time.sleep(0.2)
        assert answer is not None and answer.status_code == 200, "serve did not come up"


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["pin", "ls"], {"KVSTORE_STORE_URL": "[]"}, "store_url"),
        (["pin", "ls"], {"KVSTORE_PIN_SYNC_S": "inf"}, "pin_sync_s"),
        (["pin", "ls"], {"KVSTORE_OUTAGE_COOLDOWN_S": "nan"}, "outage_cooldown_s"),
        (["pin", "ls"], {"KVSTORE_PROBE_HIT_TTL_S": "1e999"}, "probe_hit_ttl_s"),
        (["pin", "ls"], {"KVSTORE_ADMIN_PORT": "99999"}, "admin_port"),
        (["pin", "ls"], {"KVSTORE_VLLM_URLS": "[http://x"}, "vllm_urls"),
        (["pin", "ls"], {"KVSTORE_VLLM_URLS": "ftp://x"}, "vllm_urls"),
        (["pin", "ls"], {"KVSTORE_VLLM_URLS": '{"a": 1}'}, "vllm_urls"),
        (["pin", "ls"], {"KVSTORE_CACHE_DIR": ""}, "cache_dir"),
        (["pin", "ls"], {"KVSTORE_CACHE_DIR": "  "}, "cache_dir"),
        (["pin", "ls"], {"KVSTORE_DATA_DIR": ""}, "data_dir"),
        (["fsck"], {"KVSTORE_CACHE_DIR": ""}, "cache_dir"),
        (["serve", "--port", "99999"], {}, "admin_port"),
        (["serve", "--port", "-1"], {}, "admin_port"),
        (["serve", "--port", "0"], {}, "admin_port"),
        (["gc", "--ttl-seconds", "nan"], {}, "--ttl-seconds"),
        (["gc", "--ttl-seconds", "inf"], {}, "--ttl-seconds"),
        (["gc", "--ttl-seconds", "60", "--grace-seconds", "nan"], {}, "--grace-seconds"),
        (["gc", "--ttl-seconds", "60", "--max-bytes", "-1"], {}, "--max-bytes"),
        (["bench", "multiturn", "--tier-options", "[1]"], {}, "--tier-options"),
        (["bench", "fleet", "--tier-options", "{oops"], {}, "--tier-options"),
        (["bench", "fleet", "--server-core", "--no-pin-nodes"], {}, "--server-core"),
        (
            ["pin", "add", "p", "--namespace", "m_0123456789ab", "--token-ids", "1", "--ttl-seconds", "nan"],
            {},
            "--ttl-seconds",
        ),
    ],
)
def test_bad_settings_and_arguments_exit_2_and_name_the_option(
    tmp_path: Path, args: list[str], env: dict[str, str], named: str
) -> None:
    # The store URL points nowhere reachable: a refusal must come before any store is contacted.
    base = {"KVSTORE_STORE_URL": "s3://bucket", "KVSTORE_S3_ENDPOINT": "http://127.0.0.1:9"}
    result = _run(args, cli_env(tmp_path, **{**base, **env}), timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert named in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["http://x", "http://x/", '["http://x"]', ""])
def test_one_vllm_url_or_a_json_list_in_the_environment(tmp_path: Path, value: str) -> None:
    env = cli_env(tmp_path, KVSTORE_STORE_URL=f"file://{tmp_path / 'store'}", KVSTORE_VLLM_URLS=value)
    result = _run(["pin", "ls"], env)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_empty_cache_dir_never_puts_the_cache_in_the_working_directory(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    env = cli_env(tmp_path, KVSTORE_STORE_URL=f"file://{tmp_path / 'store'}", KVSTORE_CACHE_DIR="")
    result = subprocess.run([*KVSTORE, "fsck"], env=env, cwd=work, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cache_dir" in result.stderr and "empty" in result.stderr
    assert list(work.iterdir()) == []


def test_messages_are_printed_as_they_are_never_as_markup(tmp_path: Path) -> None:
    # A message quoting something with rich's markup syntax in it (here a config file's path).
    odd = tmp_path / "[/red]" / "[bold]x.json"
    result = _run(["pin", "ls"], cli_env(tmp_path, KVSTORE_CONFIG_FILE=str(odd)))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert str(odd) in result.stderr and "cannot read config file" in result.stderr


def test_unknown_kvstore_variables_are_named_in_a_warning(tmp_path: Path) -> None:
    env = cli_env(tmp_path, KVSTORE_STORE_URL="memory://x", KVSTORE_CACH_BYTES="5", KVSTORE_STOREURL="s3://b")
    result = _run(["pin", "ls"], env)
    assert result.returncode == 0, result.stderr
    assert "KVSTORE_CACH_BYTES" in result.stderr and "KVSTORE_STOREURL" in result.stderr
    assert "KVSTORE_STORE_URL" not in result.stderr.replace("KVSTORE_STORE_URL=", "")


def _read_only_dir(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "ro"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a read-only file system here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.fixture(params=["read-only file system", "parent is a file"])
def unwritable(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    if request.param == "parent is a file":
        (tmp_path / "a-file").write_text("")
        yield tmp_path / "a-file"
    else:
        yield from _read_only_dir(tmp_path)


@pytest.mark.parametrize("args", [["pin", "ls"], ["gc", "--dry-run"], ["stats"]])
def test_a_store_directory_that_cannot_be_created_is_a_clear_error(
    tmp_path: Path, unwritable: Path, args: list[str]
) -> None:
    env = cli_env(
        tmp_path, KVSTORE_STORE_URL=f"file://{unwritable / 'store'}", KVSTORE_CACHE_DIR=str(tmp_path / "c")
    )
    result = _run(args, env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot create" in result.stderr and str(unwritable / "store") in result.stderr
    assert "Traceback" not in result.stderr
