"""The fork server starts children as `python -m MODULE ARGS` would run: their own session, environment,
working directory and log; their exit status as `Popen` reports it; nothing left once it is closed.

Preloading nothing keeps these tests fast; the vLLM tests use it with vLLM preloaded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.connector.harness.forkserver import ForkedProcess, ForkServer
from tests.helpers import wait_for

PROBE = "tests.connector.harness.fork_probe"


@pytest.fixture
def server() -> Iterator[ForkServer]:
    fork_server = ForkServer(dict(os.environ), preload=())
    yield fork_server
    fork_server.close()


def _spawn(server: ForkServer, tmp_path: Path, name: str, *args: str, **env: str) -> ForkedProcess:
    return server.spawn(
        PROBE,
        list(args),
        env=env,
        log_path=tmp_path / f"{name}.log",
        status_path=tmp_path / f"{name}.status",
        cwd=tmp_path,
    )


def _seen(tmp_path: Path, name: str) -> dict[str, Any]:
    log = tmp_path / f"{name}.log"
    wait_for(lambda: log.exists() and log.read_text().strip(), timeout=30, what="the probe's line")
    return json.loads(log.read_text().splitlines()[0])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_child_has_its_own_args_env_cwd_session_and_log(server: ForkServer, tmp_path: Path) -> None:
    child = _spawn(server, tmp_path, "a", "--flag", "x", PROBE_TEST="1")
    assert child.wait(timeout=30) == 0
    seen = _seen(tmp_path, "a")
    assert seen["args"] == ["--flag", "x"]
    assert seen["env"] == {"PROBE_TEST": "1"}  # exactly the environment asked for, nothing of the server's
    assert seen["cwd"] == str(tmp_path)
    assert seen["pid"] == child.pid == seen["pgid"] == seen["sid"]  # leads a session: killpg reaches it all


def test_exit_codes_come_back_as_popen_gives_them(server: ForkServer, tmp_path: Path) -> None:
    assert _spawn(server, tmp_path, "three", PROBE_EXIT="3").wait(timeout=30) == 3
    missing = server.spawn(
        "no_such_module_here", [], env={}, log_path=tmp_path / "m.log", status_path=tmp_path / "m.status"
    )
    assert missing.wait(timeout=30) == 1
    assert "No module named no_such_module_here" in (tmp_path / "m.log").read_text()
    staying = _spawn(server, tmp_path, "stay", "--stay")
    _seen(tmp_path, "stay")
    assert staying.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        staying.wait(timeout=0.2)
    os.killpg(staying.pid, signal.SIGKILL)
    assert staying.wait(timeout=30) == -signal.SIGKILL


def test_closing_the_server_kills_what_it_started(tmp_path: Path) -> None:
    server = ForkServer(dict(os.environ), preload=())
    child = _spawn(server, tmp_path, "stay", "--stay")
    _seen(tmp_path, "stay")
    assert _alive(child.pid)
    server.close()
    wait_for(lambda: not _alive(child.pid), timeout=10, what="the child gone")
    with pytest.raises(RuntimeError, match="fork server is gone"):
        _spawn(server, tmp_path, "late")


def test_a_server_that_cannot_preload_says_why() -> None:
    with pytest.raises(RuntimeError, match="did not start") as failed:
        ForkServer(dict(os.environ), preload=("no_such_module_here",))
    assert "No module named 'no_such_module_here'" in str(failed.value)
