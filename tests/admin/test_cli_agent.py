"""`kvstore agent` as an operator runs it: one per cache directory, a second one waits to take over, status
and stop from the command line, the admin service hosting none when one runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.agent.supervisor import agent_status
from tests.helpers import cli_env, wait_for

KVSTORE = [sys.executable, "-m", "kvstore.admin.cli"]


pytestmark = pytest.mark.slow


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return cli_env(
        tmp_path,
        KVSTORE_STORE_URL=(tmp_path / "store").as_uri(),
        KVSTORE_CACHE_DIR=str(tmp_path / "nvme"),
        KVSTORE_CACHE_BYTES=str(1 << 30),
        KVSTORE_PIN_SYNC_S="0",
    )


# `kvstore agent` with a defect in its loop (the agent's thread raises at once).
_BROKEN = """
import sys
from kvstore.admin.cli import main
from kvstore.agent.node_agent import NodeAgent

def broken(self, work):
    raise RuntimeError("a defect in the agent's loop")

NodeAgent._loop = broken
sys.argv = ["kvstore", "agent"]
sys.exit(main())
"""


def test_an_agent_that_stops_on_an_error_exits_non_zero(tmp_path: Path, env: dict[str, str]) -> None:
    """So that a service manager restarts it (before: status 0, as if asked to stop)."""
    failed = subprocess.run([sys.executable, "-c", _BROKEN], env=env, capture_output=True, text=True)
    assert failed.returncode == 3, failed.stderr[-2000:]
    assert "a defect in the agent's loop" in failed.stderr
    assert not agent_status(tmp_path / "nvme").running


def test_one_agent_per_directory_and_a_second_takes_over(tmp_path: Path, env: dict[str, str]) -> None:
    first = subprocess.Popen([*KVSTORE, "agent"], env=env, stderr=subprocess.PIPE, text=True)
    second: subprocess.Popen[str] | None = None
    try:
        wait_for(lambda: agent_status(tmp_path / "nvme").pid == first.pid, what="the first agent")
        second = subprocess.Popen([*KVSTORE, "agent"], env=env, stderr=subprocess.PIPE, text=True)
        status = subprocess.run([*KVSTORE, "agent", "--status"], env=env, capture_output=True, text=True)
        assert status.returncode == 0 and f"pid {first.pid}" in status.stdout
        assert second.poll() is None, "a second agent waits rather than exits (a DaemonSet would restart it)"
        first.send_signal(signal.SIGTERM)
        assert first.wait(20) == 0
        wait_for(lambda: agent_status(tmp_path / "nvme").pid == second.pid, what="the second to take over")
        stop = subprocess.run([*KVSTORE, "agent", "--stop"], env=env, capture_output=True, text=True)
        assert stop.returncode == 0, stop.stderr
        assert second.wait(20) == 0
        assert not agent_status(tmp_path / "nvme").running
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
