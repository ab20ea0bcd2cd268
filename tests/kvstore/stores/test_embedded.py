"""The embedded SeaweedFS default: persistent private credentials, a ready bucket, restarts that keep data."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.errors import StoreAuthError
from kvstore.stores import S3Store, embedded, embedded_ports
from kvstore.stores.embedded import SeaweedServer, ensure_embedded_server, find_weed_binary
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def litter(*servers: SeaweedServer) -> set[Path]:
    """What weed would leave in /tmp: glog files, and the local gRPC sockets on these servers' ports (other
    servers may run on the machine meanwhile, another test's or a benchmark's, with sockets of their own)."""
    tmp = Path("/tmp")
    sockets = {
        path for s in servers for port in s.ports.values() for path in tmp.glob(f"seaweedfs-*-{port}.sock")
    }
    return sockets | set(tmp.glob("weed.*"))


def test_credentials_persist_with_0600_and_are_reused(tmp_path: Path) -> None:
    data_dir = tmp_path / "embedded"
    before = litter()
    server = ensure_embedded_server(data_dir, bucket="kvb")
    try:
        creds_file = data_dir / "credentials.json"
        assert stat.S_IMODE(creds_file.stat().st_mode) == 0o600
        saved = json.loads(creds_file.read_text())
        assert (saved["access_key"], saved["secret_key"]) == (server.access_key, server.secret_key)
        assert server.start_seconds is not None
        assert (data_dir / "weed.log").is_file()
        with server.store("kvb") as store:
            store.check()
            store.put("k", b"persisted")
        with (
            S3Store(
                "kvb", endpoint=server.endpoint, access_key=server.access_key, secret_key="not-the-secret"
            ) as store,
            pytest.raises(StoreAuthError),
        ):
            store.check()
    finally:
        server.stop()

    again = ensure_embedded_server(data_dir, bucket="kvb")
    try:
        assert (again.access_key, again.secret_key) == (saved["access_key"], saved["secret_key"])
        with again.store("kvb") as store:
            assert store.get("k") == b"persisted"
    finally:
        again.stop()
    # Its sockets and logs went with it (the log is weed.log in the data dir).
    assert litter(server, again) <= before


def test_a_running_embedded_server_is_shared_not_started_twice(tmp_path: Path) -> None:
    data_dir = tmp_path / "embedded"
    owner = ensure_embedded_server(data_dir, bucket="kvb")
    try:
        shared = ensure_embedded_server(data_dir, bucket="kvb")
        assert owner.owned and not shared.owned
        assert shared.endpoint == owner.endpoint
        shared.stop()  # a sharer's stop leaves the owner's server serving
        with owner.store("kvb") as store:
            store.put("k", b"still up")
            assert store.get("k") == b"still up"
    finally:
        owner.stop()
    # The owner is gone: the next caller starts (and owns) a fresh server on the same data.
    fresh = ensure_embedded_server(data_dir, bucket="kvb")
    try:
        assert fresh.owned and fresh.running
        with fresh.store("kvb") as store:
            assert store.get("k") == b"still up"
    finally:
        fresh.stop()


def test_restart_keeps_ports_and_data(tmp_path: Path) -> None:
    with SeaweedServer(tmp_path / "sw") as server:
        endpoint = server.endpoint
        with server.store("rb1") as store:
            store.create_bucket()
            store.put("a", b"1")
            server.restart()
            assert server.endpoint == endpoint
            assert store.get("a") == b"1"
    server.stop()  # stopping again (leaving the block stopped it) is harmless
    assert not server.running


def test_a_start_removes_what_earlier_runs_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A master state per earlier master port, a cut maintenance pass's scratch, an overgrown log: gone at
    the next start; the data and the current master's state stay."""
    monkeypatch.setattr(embedded, "_LOG_KEEP_BYTES", 1024)
    data = tmp_path / "sw"
    with SeaweedServer(data) as server, server.store("tidy") as store:
        store.create_bucket()
        store.put("a", b"1")
        current = data / "weed" / f"m{server.ports['master.port']}"
        assert current.is_dir()
        stale = data / "weed" / "m12345"
        (stale / "log").mkdir(parents=True)
        (data / "sw_fsck42").mkdir()
        (data / "weed" / "mine").mkdir()  # not a master's: left alone
        with server.log_path.open("ab") as log:
            log.write(b"old line\n" * 200)
        server.restart()
        assert not stale.exists() and not (data / "sw_fsck42").exists()
        assert current.is_dir() and (data / "weed" / "mine").is_dir()
        assert b"old line" in (data / "weed.log.1").read_bytes()
        assert b"old line" not in server.log_path.read_bytes()
        assert store.get("a") == b"1"


def test_a_port_taken_before_weed_binds_it_means_other_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Free ports are chosen, released, then bound by weed; another process can take one in between (CI, a
    parallel test's). The first start then tries fresh ports instead of failing every test that needs S3."""
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    picks: list[list[int]] = []
    choose = embedded_ports.free_ports

    def first_pick_has_a_taken_port(count: int, host: str) -> list[int]:
        ports = choose(count, host)
        if not picks:
            ports[embedded_ports.PORT_NAMES.index("filer.port")] = taken_port  # weed exits at once
        picks.append(ports)
        return ports

    monkeypatch.setattr(embedded_ports, "free_ports", first_pick_has_a_taken_port)
    try:
        with SeaweedServer(tmp_path / "sw") as server, server.store("taken") as store:
            store.create_bucket()
            store.put("a", b"1")
            assert store.get("a") == b"1"
            assert len(picks) == 2 and taken_port not in server.ports.values()
    finally:
        taken.close()
    assert str(taken_port) in (tmp_path / "sw" / "weed.log").read_text()


def test_a_launch_whose_log_shows_a_failed_bind_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What CI met: weed's own check of its ports passed, then its admin server found its port taken; S3
    served, and weed exited two minutes later. Here weed's line from then is added to its log once S3
    serves: that launch is stopped and the server starts again on other ports."""
    wait_ready = SeaweedServer._wait_ready
    launches: list[dict[str, int]] = []

    def ready_then_admin_fails(server: SeaweedServer, deadline: float) -> None:
        wait_ready(server, deadline)
        launches.append(server.ports)
        if len(launches) == 1:
            with server.log_path.open("a") as log:
                port = server.ports["admin.port"]
                log.write(f"E mini.go:1673 Admin server error: listen tcp 127.0.0.1:{port}: ")
                log.write("bind: address already in use\n")

    monkeypatch.setattr(SeaweedServer, "_wait_ready", ready_then_admin_fails)
    with SeaweedServer(tmp_path / "sw") as server, server.store("rebound") as store:
        store.create_bucket()
        store.put("a", b"1")
        assert store.get("a") == b"1"
        assert len(launches) == 2 and launches[0] != launches[1] == server.ports


def test_space_of_deleted_objects_is_reclaimed_at_the_next_start(tmp_path: Path) -> None:
    data_dir = tmp_path / "embedded"

    def volume_bytes() -> int:
        return sum(f.stat().st_size for f in (data_dir / "weed").glob("*.dat"))

    server = ensure_embedded_server(data_dir, bucket="kvb")
    stamp = data_dir / "purge.stamp"
    wait_for(stamp.exists, timeout=60, what="the first start's orphan purge")
    keys = [f"bench/{i}" for i in range(24)]
    try:
        with server.store("kvb") as store:
            for key in keys:
                store.put(key, bytes(1 << 20))
            store.put("kept", b"live data survives the compaction")
            store.delete_many(keys)  # what a benchmark or GC does at its end
    finally:
        # Killed at once, as by a crash: the filer had no time to pass the deletions on to the volume, whose
        # chunks are now referenced by nothing (a graceful stop loses them too, now and then).
        server.stop(kill=True)
    assert volume_bytes() >= 24 << 20  # deleting only marks the space

    a_day_ago = time.time() - 24 * 3600 - 60  # the purge walks the whole filer: at most once a day
    os.utime(stamp, (a_day_ago, a_day_ago))
    again = ensure_embedded_server(data_dir, bucket="kvb")
    try:
        deadline = time.monotonic() + 30
        while volume_bytes() >= 8 << 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert volume_bytes() < 8 << 20
        with again.store("kvb") as store:
            assert store.get("kept") == b"live data survives the compaction"
            assert store.get(keys[0]) is None
    finally:
        again.stop()


def test_a_nodes_own_server_runs_at_idle_priority_a_plain_one_does_not(tmp_path: Path) -> None:
    """`ensure_embedded_server` (the node's server, beside its engines) runs weed at SCHED_IDLE, every thread;
    a `SeaweedServer` standing in for an S3 service keeps normal priority."""
    sched_idle = 5

    def policies(pid: int | None) -> set[int]:
        assert pid is not None
        return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}

    node = ensure_embedded_server(tmp_path / "node", bucket="kvb")
    try:
        assert policies(node.pid) == {sched_idle}
    finally:
        node.stop()
    with SeaweedServer(tmp_path / "service") as service:
        assert sched_idle not in policies(service.pid)


def test_the_servers_go_runtime_keeps_its_memory_for_the_next_requests(tmp_path: Path) -> None:
    """No collection below a memory limit (see `embedded._GO_RUNTIME`): what weed's environment says."""
    with SeaweedServer(tmp_path / "sw") as server:
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
        assert b"GOGC=off" in environ
        assert any(line.startswith(b"GOMEMLIMIT=") and line.endswith(b"MiB") for line in environ)


def test_the_orphan_purge_runs_at_most_once_a_day(tmp_path: Path) -> None:
    """It walks every entry of the filer (at every start it would cost a big bucket minutes of CPU): a start
    within a day of the last purge only compacts."""
    data_dir = tmp_path / "embedded"
    shell_log = data_dir / "weed-shell.log"

    def passes() -> list[str]:  # the commands of each maintenance pass, as its log records them
        return [line for line in shell_log.read_text().splitlines() if line.startswith("# ")]

    server = ensure_embedded_server(data_dir, bucket="kvb")
    wait_for((data_dir / "purge.stamp").exists, timeout=60, what="the first start's orphan purge")
    server.stop()
    assert ["volume.fsck" in line for line in passes()] == [True]
    again = ensure_embedded_server(data_dir, bucket="kvb")
    try:
        wait_for(lambda: len(passes()) > 1, timeout=60, what="the next start's first maintenance pass")
        assert "volume.vacuum" in passes()[1] and "volume.fsck" not in passes()[1]
    finally:
        again.stop()


def _http(method: str, url: str, **kwargs: Any) -> int:
    """The status code, or 0 when the port does not speak HTTP at all."""
    try:
        return httpx.request(method, url, timeout=5, **kwargs).status_code
    except httpx.HTTPError:
        return 0


def test_only_the_s3_port_answers_without_the_servers_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any local user can connect to the loopback ports: only S3 with credentials may read or write."""
    monkeypatch.setenv("KVSTORE_ADMIN_TOKEN", "admin-token-never-in-weed")
    monkeypatch.setenv("S3_BUCKET", "made-by-the-caller")  # weed would create it on its own
    monkeypatch.setenv("WEED_JWT_SIGNING_KEY", "a-key-an-attacker-chose")
    with SeaweedServer(tmp_path / "sw") as server:
        assert server.pid is not None
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
        names = {entry.split(b"=", 1)[0].decode() for entry in environ if entry}
        assert names <= {
            "PATH",
            "LANG",
            "LC_ALL",
            "TZ",
            "HOME",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "GOGC",
            "GOMEMLIMIT",
        }
        assert b"admin-token-never-in-weed" not in b"\0".join(environ)
        assert stat.S_IMODE((tmp_path / "sw").stat().st_mode) == 0o700

        with server.store("door") as store:
            store.create_bucket()
            store.put("obj", b"the real object")
            ports = server.ports
            filer, master, volume = (
                f"http://127.0.0.1:{ports[n]}" for n in ("filer.port", "master.port", "volume.port")
            )
            attempts = [
                ("GET", f"{filer}/buckets/door/obj", {}),
                ("GET", f"{filer}/buckets/door/", {}),
                ("PUT", f"{filer}/buckets/door/planted", {"content": b"evil"}),
                ("POST", f"{filer}/buckets/door/planted", {"files": {"file": ("x", b"evil")}}),
                ("GET", f"{master}/dir/assign", {}),
                ("POST", f"{master}/col/delete?collection=door", {}),
                ("POST", f"{master}/submit", {"files": {"file": ("x", b"evil")}}),
                ("POST", f"{volume}/1,01637037d6", {"files": {"file": ("x", b"evil")}}),
                ("GET", f"{volume}/1,01637037d6", {}),
            ]
            answers = {f"{method} {url}": _http(method, url, **kw) for method, url, kw in attempts}
            assert not {k: v for k, v in answers.items() if 200 <= v < 300}, answers
            assert store.get("obj") == b"the real object" and store.get("planted") is None
            assert [b for b in store._client.list_buckets() if b.name == "made-by-the-caller"] == []

            # gRPC without the server's client certificate: `weed shell` cannot list the bucket.
            master_grpc = f"127.0.0.1:{ports['master.port']}.{ports['master.port.grpc']}"
            outside = tmp_path / "elsewhere"
            outside.mkdir()
            try:
                shell = subprocess.run(
                    # -logtostderr: no glog file in /tmp, where a test beside this one looks for litter
                    [str(find_weed_binary()), "-logtostderr", "shell", f"-master={master_grpc}"],
                    input="fs.ls /buckets/door\n",
                    capture_output=True,
                    text=True,
                    cwd=outside,
                    env={"PATH": os.environ.get("PATH", ""), "HOME": str(outside)},
                    timeout=10,
                )
                assert "obj" not in shell.stdout
            except subprocess.TimeoutExpired as exc:  # it keeps retrying the refused TLS handshake
                assert b"obj" not in (exc.stdout or b"")


def shells_in(data_dir: Path) -> list[int]:
    """The `weed shell` processes working in `data_dir` (the server's maintenance passes)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            mine = proc.name.isdigit() and (proc / "cwd").resolve() == data_dir.resolve()
            if mine and b"shell" in (proc / "cmdline").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue  # exited meanwhile, or not ours to read
    return found


def test_a_maintenance_pass_that_starts_after_stop_ends_at_once(tmp_path: Path) -> None:
    """The background pass checks the server, then starts a shell: a stop in between left a shell retrying
    a dead master for minutes, beyond the test or command that started the server."""
    server = SeaweedServer(tmp_path / "sw")
    server.start()
    process, ports = server._process, server.ports
    assert process is not None
    master = f"127.0.0.1:{ports['master.port']}.{ports['master.port.grpc']}"
    server.stop()
    late_pass = threading.Thread(
        target=server._shell_pass, args=(process, master, ["volume.vacuum"]), daemon=True
    )
    late_pass.start()
    late_pass.join(20)
    assert not late_pass.is_alive(), "the shell outlived its server"
    assert shells_in(server.data_dir) == []


def test_a_benchmark_can_wait_for_the_maintenance_after_a_start(tmp_path: Path) -> None:
    """The passes that follow a start (a vacuum each, the last about 20 s after it) are over when
    `wait_maintained` says so, and not before."""
    with SeaweedServer(tmp_path / "sw") as server:
        assert not server.wait_maintained(0.01)
        assert server.wait_maintained(120)
        passes = [
            line for line in (tmp_path / "sw" / "weed-shell.log").read_text().splitlines() if line[:2] == "# "
        ]
        assert len(passes) == 5 and all("volume.vacuum" in line for line in passes)
