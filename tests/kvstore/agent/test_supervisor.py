"""The node agent as a process: started by the first engine on a node (detached, at idle priority), one per
cache directory, a dead or hung one replaced, engines serving while none runs, nothing reported stored ever
lost. Real processes, a real cache, a real S3 server."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvstore.agent.supervisor import settings_payload, spawn_agent, stop_agent
from kvstore.config import Settings
from kvstore.metrics import EngineMetrics
from kvstore.node.agent_files import HUNG_S, STATUS_NAME, AgentLock, agent_status
from kvstore.node.engines import live_engines
from kvstore.node.watch import AgentWatch
from kvstore.runtime import open_node
from tests.engine_helpers import keys, load, payload
from tests.helpers import sample, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_SCHED_IDLE = 5
_IOPRIO_CLASS_IDLE = 3


def test_the_first_engine_starts_an_agent_that_uploads_for_every_engine(
    settings: Settings, open_engine_node: Any
) -> None:
    first = open_engine_node()
    wait_for(lambda: agent_status(settings.cache_dir).running, what="the agent the engine started")
    status = agent_status(settings.cache_dir)
    assert status.pid not in (None, os.getpid()), "a process of its own"
    second = open_engine_node()  # another engine on the node: no second agent
    assert agent_status(settings.cache_dir).pid == status.pid
    assert sorted(live_engines(settings.cache_dir)) == [os.getpid()]
    names = keys(6, "two-engines")
    first.engine.store_many([(k, payload(i)) for i, k in enumerate(names[:3])])
    second.engine.store_many([(k, payload(i)) for i, k in enumerate(names[3:], start=3)])
    wait_for(lambda: first.cache.backlog().chunks == 0, what="the agent to upload both engines' chunks")
    assert all(first.store.exists_many(names))
    assert second.engine.metrics.agent_up._value.get() == 1  # type: ignore[attr-defined]


def test_the_agent_runs_at_idle_cpu_and_io_priority(settings: Settings, open_engine_node: Any) -> None:
    open_engine_node()
    pid = wait_for_agent(settings)
    wait_for(lambda: len(os.listdir(f"/proc/{pid}/task")) > 3, what="the agent's threads")
    threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    assert {os.sched_getscheduler(tid) for tid in threads} == {_SCHED_IDLE}, "every thread"
    number = {"x86_64": 252, "aarch64": 31}.get(platform.machine())  # ioprio_get
    if number is None:
        pytest.skip(f"no ioprio_get number known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    classes = {libc.syscall(number, 1, tid) >> 13 for tid in threads}  # IOPRIO_WHO_PROCESS, per thread
    assert classes == {_IOPRIO_CLASS_IDLE}


def test_no_secret_reaches_the_agents_arguments_or_environment(settings: Settings) -> None:
    spawn_agent(settings, exit_when_idle_s=30)
    pid = wait_for_agent(settings)
    secret = settings.secret_key.get_secret_value().encode() if settings.secret_key else b""
    assert secret
    assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert secret not in Path(f"/proc/{pid}/environ").read_bytes()
    assert secret in settings_payload(settings), "it reads them from its stdin"


def wait_for_agent(settings: Settings) -> int:
    def running_pid() -> int | None:
        status = agent_status(settings.cache_dir)
        return status.pid if status.running else None

    return wait_for_value(running_pid)


def wait_for_value(fn: Any) -> Any:
    from tests.helpers import wait_value

    return wait_value(fn, what="the agent to run")


def test_engines_serve_without_an_agent_and_a_new_one_uploads_everything(
    settings: Settings,
    open_engine_node: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Killed with SIGKILL, the agent leaves its lock to the kernel; the engine keeps serving from NVMe,
    says the agent is down (metric, log), starts a new one, and nothing it reported stored is lost."""
    monkeypatch.setattr("kvstore.node.watch.RESTART_EVERY_S", 5.0)  # a restart 5 s after the first start
    node = open_engine_node()
    pid = wait_for_agent(settings)
    os.kill(pid, signal.SIGSTOP)  # frozen first, so the chunks below stay in the journal
    names = keys(8, "agent-killed")
    assert node.engine.store_many([(k, payload(i)) for i, k in enumerate(names)]).written == 8
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not agent_status(settings.cache_dir).running, what="the lock to go with the agent")
    assert load(node.engine, names) == [payload(i) for i in range(8)], "served from NVMe meanwhile"
    with caplog.at_level(logging.WARNING, logger="kvstore.node.watch"):
        watch = AgentWatch(settings.cache_dir, every_s=0)
        assert not watch.check()
    assert "no node agent runs" in caplog.text
    node.engine.housekeeping()  # the engine's own watch: down, so it starts one (at most every 30 s)
    wait_for(lambda: all(node.store.exists_many(names)), timeout=60, what="the new agent's uploads")
    assert agent_status(settings.cache_dir).pid != pid

    def agent_up() -> bool:
        node.engine.housekeeping()  # the engine looks again every few seconds
        return sample(node.engine.metrics, "kvstore:agent_up") == 1

    wait_for(agent_up, what="the engine to see the new agent")


def test_an_engine_told_the_agent_is_external_only_reports(settings: Settings, open_engine_node: Any) -> None:
    node = open_engine_node("none")
    node.engine.housekeeping()
    time.sleep(0.5)
    assert not agent_status(settings.cache_dir).running, "nothing started"
    assert node.cache.backlog().chunks == 0


def test_a_hung_agent_is_replaced(settings: Settings) -> None:
    spawn_agent(settings, exit_when_idle_s=30)
    pid = wait_for_agent(settings)
    os.kill(pid, signal.SIGSTOP)  # holds the lock, does nothing, is not runnable
    status_file = Path(settings.cache_dir) / STATUS_NAME
    past = time.time() - HUNG_S - 10
    os.utime(status_file, (past, past))  # no heartbeat for longer than HUNG_S
    wait_for(lambda: agent_status(settings.cache_dir).hung, what="the stopped agent to count as hung")
    lock = AgentLock(settings.cache_dir)
    try:
        assert lock.acquire(wait_s=10), "the hung agent was killed and its lock taken"
        wait_for(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), what="the hung agent to die")
    finally:
        lock.release()


_BUSY_HOLDER = """
import sys
from kvstore.node.agent_files import AgentLock
assert AgentLock(sys.argv[1]).acquire(wait_s=5)
print("locked", flush=True)
while True:
    pass
"""


def test_a_starved_agent_is_not_taken_for_hung(tmp_path: Path) -> None:
    """An idle-priority agent on a saturated node may not beat for minutes; while it is runnable it is left
    alone. Only a silent agent that is not even runnable (stopped, deadlocked) is hung."""
    import subprocess
    import sys

    directory = tmp_path / "nvme"
    directory.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _BUSY_HOLDER, str(directory)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        past = time.time() - HUNG_S - 10
        os.utime(directory / STATUS_NAME, (past, past))
        status = agent_status(directory)
        assert status.running and status.pid == holder.pid
        assert not status.hung, "a runnable process is starved, not hung"
        assert not AgentLock(directory).acquire(wait_s=0.3)
        os.kill(holder.pid, signal.SIGSTOP)
        wait_for(lambda: agent_status(directory).hung, what="a stopped silent holder to count as hung")
    finally:
        holder.kill()
        holder.wait(10)


def test_stop_agent_stops_it(settings: Settings) -> None:
    spawn_agent(settings, exit_when_idle_s=30)
    wait_for_agent(settings)
    assert stop_agent(settings.cache_dir, timeout_s=10)
    assert not agent_status(settings.cache_dir).running
    assert "node agent stopped" in (Path(settings.cache_dir) / "agent.log").read_text()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
        return True


_ENGINE_PROCESS = """
import json, sys, time
from prometheus_client import CollectorRegistry
from kvstore.config import load_settings
from kvstore.metrics import EngineMetrics
from kvstore.runtime import open_node
settings = load_settings(**json.loads(sys.argv[1]))
node = open_node(settings, metrics=EngineMetrics(CollectorRegistry()), agent="spawn")
tag = sys.argv[2]
node.engine.store_many([(f"ns_abc_r0/{tag}/{i:04d}.bin", bytes([i]) * 65536) for i in range(5)])
print("stored", flush=True)
sys.stdin.readline()  # the test says when to go
node.close()
"""


def test_two_engine_processes_on_one_node_share_one_agent(settings: Settings) -> None:
    import subprocess
    import sys

    payload = settings_payload(settings).decode()
    engines = [
        subprocess.Popen(
            [sys.executable, "-c", _ENGINE_PROCESS, payload, tag],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for tag in ("first", "second")
    ]
    try:
        for engine in engines:
            assert engine.stdout is not None and engine.stdout.readline().strip() == "stored"
        pid = wait_for_agent(settings)
        assert pid not in [e.pid for e in engines], "a process of its own"
        assert sorted(live_engines(settings.cache_dir)) == sorted(e.pid for e in engines)
        node = open_node(settings, metrics=EngineMetrics(CollectorRegistry()), agent="none")
        try:
            wait_for(
                lambda: node.cache.backlog().chunks == 0, what="one agent to upload both engines' chunks"
            )
            names = [f"ns_abc_r0/{tag}/{i:04d}.bin" for tag in ("first", "second") for i in range(5)]
            assert all(node.store.exists_many(names))
        finally:
            node.close()
        assert agent_status(settings.cache_dir).pid == pid, "still the one agent"

        def agents() -> list[str]:
            return [
                p
                for p in os.listdir("/proc")
                if p.isdigit() and _is_agent_of(int(p), str(settings.cache_dir))
            ]

        # Both engines may have started one at the same moment: the second gives way at once.
        wait_for(lambda: agents() == [str(pid)], what="one agent process for the directory")
    finally:
        for engine in engines:
            if engine.poll() is None:
                assert engine.stdin is not None
                engine.stdin.write("\n")
                engine.stdin.flush()
            engine.wait(30)


def _is_agent_of(pid: int, cache_dir: str) -> bool:
    """Whether `pid` runs `python -m kvstore.agent` holding `cache_dir`'s lock."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    if b"kvstore.agent" not in cmdline:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == f"{cache_dir}/agent.lock":
                return True
        except OSError:
            continue
    return False
