"""Start vLLM processes by forking one that has imported vLLM already: each start skips the ~10 s import.

A test run starts dozens of engines and servers, and on these machines most of each start is Python importing
vLLM, torch and transformers again (the engine itself is up a second later). A fork server imports them once
and forks a child per start; the child is what ``python -m MODULE ARGS`` would be (its own session, its own
environment, working directory and log), so stopping it by its process group works as before.

Opt-in: ``with forked_vllm():`` makes ``engine_runner`` and ``vllm_server`` start their processes here (the
test suite does, for the whole session; benchmarks start theirs plainly). The server is started at the first
spawn, not before, and stops at the end of the block, killing what it started.

The fork server runs no torch operation before it forks: a child forked after OpenMP started its threads
hangs in its first parallel region. Nor does it start threads; it waits on its pipe and reaps its children,
writing each one's exit status where its parent looks for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

from kvstore.priority import die_with_parent

__all__ = [
    "VLLM_MODULES",
    "ChildProcess",
    "ForkServer",
    "ForkedProcess",
    "active",
    "forked_vllm",
]

# What the children run: the engine runner's child and `vllm serve`'s entry point, with what they import.
VLLM_MODULES = (
    "vllm",
    "vllm.inputs",
    "vllm.entrypoints.llm",
    "vllm.entrypoints.openai.api_server",
    "kvstore.connector.harness.engine_child",
)  # not the tier: a child imports it itself, so a tier that fails to import fails that child, with its log
_START_TIMEOUT_S = 180.0
_SPAWN_TIMEOUT_S = 30.0


class ChildProcess(Protocol):
    """What the harness needs of a started process: ``subprocess.Popen`` and ``ForkedProcess`` both are."""

    @property
    def pid(self) -> int: ...

    @property
    def args(self) -> Any: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class ForkedProcess:
    """A child of the fork server; its exit status (as ``Popen.returncode`` gives it) appears in a file."""

    pid: int
    status_path: Path
    args: list[str]

    def poll(self) -> int | None:
        try:
            return int(self.status_path.read_text())
        except (OSError, ValueError):
            return None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.05)
        return rc


class ForkServer:
    """A process that imported vLLM once and forks ``python -m MODULE ARGS`` lookalikes on request."""

    def __init__(self, env: Mapping[str, str], preload: Sequence[str] = VLLM_MODULES) -> None:
        """Start the server with ``env``; it imports the ``preload`` modules before it answers."""
        self._lock = threading.Lock()
        self._log = _anonymous_file()  # the server's own output: what a failed start says
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            # Its children get their own environment whole; TMPDIR is the first caller's private one.
            env={k: v for k, v in env.items() if k != "TMPDIR"},
            start_new_session=True,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._in, self._out = self._proc.stdin, self._proc.stdout
        if self._reply(_START_TIMEOUT_S) != {"ready": True}:
            said = os.pread(self._log, 1 << 16, 0)[-4000:].decode(errors="replace")
            self.close()
            raise RuntimeError(f"the vLLM fork server did not start:\n{said}")

    def spawn(
        self,
        module: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        log_path: Path,
        status_path: Path,
        cwd: Path | None = None,
    ) -> ForkedProcess:
        """Start ``python -m module *args`` as a fork; its output goes to ``log_path`` (appended)."""
        request = {
            "module": module,
            "args": list(args),
            "env": dict(env),
            "cwd": str(cwd or Path.cwd()),
            "log": str(log_path),
            "status": str(status_path),
        }
        with self._lock:
            try:
                self._in.write(json.dumps(request).encode() + b"\n")
                self._in.flush()
            except (OSError, ValueError) as exc:  # a closed pipe, or closed on our side
                raise RuntimeError(f"the vLLM fork server is gone (exit status {self._proc.poll()})") from exc
            reply = self._reply(_SPAWN_TIMEOUT_S)
        if "pid" not in reply:
            raise RuntimeError(f"the vLLM fork server could not start {module}: {reply}")
        return ForkedProcess(int(reply["pid"]), status_path, [module, *args])

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        ready, _, _ = select.select([self._out], [], [], timeout_s)
        line = self._out.readline() if ready else b""
        return json.loads(line) if line else {}

    def close(self) -> None:
        """Stop the server; it kills the process groups of the children still running."""
        with contextlib.suppress(OSError):
            self._in.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._out.close()
        os.close(self._log)


def _anonymous_file() -> int:
    """A file descriptor with no name: a file the server holds open must not show up under the directory of
    whichever test started it (tests check that nothing is left open under theirs)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("kvstore-forkserver-log")
    fd, path = tempfile.mkstemp()
    os.unlink(path)
    return fd


_lock = threading.Lock()
_enabled = False
_server: ForkServer | None = None


def active(env: Mapping[str, str]) -> ForkServer | None:
    """The fork server to start vLLM processes with, inside ``forked_vllm()`` (started now if need be, with
    ``env``: what vLLM reads while it is imported); None outside it."""
    global _server
    with _lock:
        if not _enabled:
            return None
        if _server is None:
            _server = ForkServer(env)
        return _server


@contextlib.contextmanager
def forked_vllm() -> Iterator[None]:
    """Within the block, vLLM engines and servers of the harness start as forks of one preloaded process."""
    global _enabled, _server
    with _lock:
        _enabled = True
    try:
        yield
    finally:
        with _lock:
            _enabled, server, _server = False, _server, None
        if server is not None:
            server.close()


# The server's side.


def _serve(preload: Sequence[str]) -> None:
    # No parent-death signal here: Linux sends it when the *thread* that started us ends, and a benchmark
    # starts servers from pool threads. The pipe ends with our parent process instead.
    import importlib

    for module in preload:
        importlib.import_module(module)
    children: dict[int, Path] = {}
    _send({"ready": True})
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.1)
        _reap(children)
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break  # our parent closed the pipe or died
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _become(request)
            children[pid] = Path(request["status"])
            _send({"pid": pid})
    for pid in children:  # each child leads its own process group
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while children and time.monotonic() < deadline:
        _reap(children)
        time.sleep(0.05)


def _send(reply: dict[str, Any]) -> None:
    os.write(1, json.dumps(reply).encode() + b"\n")


def _reap(children: dict[int, Path]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path is not None:
            with contextlib.suppress(OSError):
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(str(os.waitstatus_to_exitcode(status)))
                tmp.rename(path)


def _become(request: dict[str, Any]) -> NoReturn:
    """In the forked child: turn into ``python -m module *args`` and exit as it would."""
    rc = 1
    try:
        os.setsid()
        die_with_parent(signal.SIGKILL)  # the fork server's death
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # TMPDIR is the child's own
        os.chdir(request["cwd"])
        rc = _run_module(request["module"], request["args"])
    except BaseException:  # whatever it was, it is this child's exit
        import traceback

        traceback.print_exc()
    finally:
        _exit(rc)


def _run_module(module: str, args: list[str]) -> int:
    import runpy

    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    return 0


def _exit(rc: int) -> NoReturn:
    """Exit as the interpreter would: atexit handlers (vLLM's and multiprocessing's), flushed output."""
    import atexit

    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(rc)


if __name__ == "__main__":
    _serve(sys.argv[1:])
