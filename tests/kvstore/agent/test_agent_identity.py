"""The agent's lock and status file are believed only as far as the kernel confirms them: a status file of
any shape is harmless, a forged one never gets another process signalled, the agent is stopped without one,
a replaced ``agent.lock`` lets no second agent in, and a spawned agent is nobody's child. Real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.agent.supervisor import spawn_agent, stop_agent
from kvstore.config import Settings
from kvstore.node.agent_files import HUNG_S, LOCK_NAME, STATUS_NAME, AgentLock, agent_status
from kvstore.node.watch import AgentWatch
from kvstore.processes import start_time
from tests.helpers import cli_env, wait_value

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# An agent as far as the lock and status file go: takes them, then waits (no heartbeat, no signal handler).
_HOLDER = """
import sys, time
from kvstore.node.agent_files import AgentLock
assert AgentLock(sys.argv[1]).acquire(wait_s=5)
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "nvme")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


_SHAPES = [
    "[1]",
    "null",
    '"x"',
    "{",
    '{"pid": "x"}',
    '{"pid": true, "process_start": "1", "lock": [1, 2], "host": "h", "started": 1, "store": ""}',
    '{"pid": 1, "process_start": "1", "lock": ["a"], "host": "h", "started": 1, "store": ""}',
]


def test_a_status_file_of_any_shape_is_harmless(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    """`[1]`, `null` or `"x"` once made /healthz answer 500 and `kvstore agent --status` a traceback."""
    directory = tmp_path / "nvme"
    env = cli_env(tmp_path, KVSTORE_CACHE_DIR=str(directory), KVSTORE_STORE_URL=(tmp_path / "s").as_uri())
    for junk in _SHAPES:
        (directory / STATUS_NAME).write_text(junk)
        status = agent_status(directory)
        assert status.running and status.pid == holder.pid, junk
        assert status.heartbeat_age_s is None and not status.hung, "a heartbeat only from the holder's file"
        assert f"pid {holder.pid}" in status.describe()
    cli = [sys.executable, "-m", "kvstore.admin.cli", "agent", "--status"]
    shown = subprocess.run(cli, env=env, capture_output=True, text=True)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert f"pid {holder.pid}" in shown.stdout


def test_a_forged_status_file_never_gets_another_process_signalled(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    """agent.json naming an innocent, stopped process (its real start time, the lock's real inode) with an old
    mtime once got that process SIGKILLed as a hung agent. Only the lock's holder is ever signalled."""
    directory = tmp_path / "nvme"
    innocent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        os.kill(innocent.pid, signal.SIGSTOP)  # not runnable, as a hung agent would be
        found = os.stat(directory)
        forged = {
            "pid": innocent.pid,
            "process_start": start_time(innocent.pid),
            "lock": [found.st_dev, found.st_ino],
            "host": socket.gethostname(),
            "started": time.time() - 1000,
            "store": "",
        }
        (directory / STATUS_NAME).write_text(json.dumps(forged))
        past = time.time() - HUNG_S - 10
        os.utime(directory / STATUS_NAME, (past, past))
        status = agent_status(directory)
        assert status.pid == holder.pid and not status.hung
        assert not AgentLock(directory).acquire(wait_s=1), "the holder is no hung agent: nothing replaced"
        AgentWatch(directory, start=lambda: None, every_s=0).check()  # an engine's look: kills hung ones
        assert stop_agent(directory, timeout_s=5), "the lock's holder is stopped"
        assert holder.wait(10) == -signal.SIGTERM
        assert innocent.poll() is None, "the process the file named is untouched"
    finally:
        innocent.kill()
        innocent.wait(10)


def test_the_agent_is_stopped_without_its_status_file(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    directory = tmp_path / "nvme"
    (directory / STATUS_NAME).unlink()
    assert agent_status(directory).pid == holder.pid, "the kernel says who holds the lock"
    assert stop_agent(directory, timeout_s=5)
    assert holder.wait(10) == -signal.SIGTERM
    assert not agent_status(directory).running


def test_replacing_agent_lock_lets_no_second_agent_in(tmp_path: Path) -> None:
    directory = tmp_path / "nvme"
    first = AgentLock(directory)
    assert first.acquire(wait_s=1)
    try:
        (directory / LOCK_NAME).unlink()  # an operator's cleanup, or someone hoping to take over
        (directory / LOCK_NAME).touch()
        second = AgentLock(directory)
        assert not second.acquire(wait_s=0.5), "the directory is locked, not only the file"
        assert agent_status(directory).pid == os.getpid()
    finally:
        first.release()
    assert second.acquire(wait_s=5), "the lock is free once the first lets go"
    second.release()


def test_a_spawned_agent_is_nobodys_child_and_leaves_no_thread(settings: Settings) -> None:
    """The tier once left a `kvstore-agent-reaper` thread in vLLM's process, waiting on its child."""
    spawn_agent(settings, exit_when_idle_s=30)
    pid = wait_value(lambda: agent_status(settings.cache_dir).pid, what="the agent to run")
    parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert parent != os.getpid(), "detached: not our child"
    assert [t.name for t in threading.enumerate() if "reaper" in t.name] == []
