"""`kvstore demo` end to end: embedded S3, admin service, a real vLLM server with our tier, a multi-turn
replay; then nothing it started is left: no process, no /dev/shm file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from kvstore.config import load_settings
from kvstore.connector.demo.run import DEMO_PREFIX, DemoOptions, DemoReport, _phases, run_demo
from kvstore.connector.harness.engine_runner import new_shm, shm_snapshot
from kvstore.connector.harness.multiturn import TurnRecord
from kvstore.engine.timeline import Timeline
from kvstore.storage import open_object_store

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

SMALL = DemoOptions(
    conversations=5,
    context_tokens=1200,
    turn_tokens=100,
    turns=2,
    output_tokens=4,
    concurrency=2,
    returning_user_tokens=1200,
    admin_port=0,  # any free port
)


def _processes_under(path: Path) -> list[str]:
    """Command lines of live processes that mention `path` in their command line (weed) or hold a file
    under it open (vLLM's processes write their logs there: a fork of a preloaded process, as the tests
    start vLLM, has that process's command line)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if str(path) in cmdline or any(str(path) in _link(fd) for fd in (proc / "fd").iterdir()):
                found.append(cmdline[:200])
        except OSError:
            continue
    return found


def _link(fd: Path) -> str:
    try:
        return os.readlink(fd)
    except OSError:
        return ""


@pytest.fixture
def data_dir(tmp_path: Path, tiny_model: Path) -> Path:
    # The demo builds its model under data_dir/demo once; reuse the session's build.
    shutil.copytree(tiny_model, tmp_path / "demo" / "tiny-llama")
    return tmp_path


def test_demo_runs_everything_and_leaves_nothing(data_dir: Path) -> None:
    shm_before = shm_snapshot()
    seen: dict[str, int] = {}

    def while_up(report: DemoReport) -> None:
        assert httpx.get(f"{report.admin_url}/healthz").status_code == 200
        assert httpx.get(f"{report.vllm_url}/health").status_code == 200
        stats = httpx.get(f"{report.admin_url}/v1/stats").json()
        seen["stats_keys"] = len(stats)
        seen["processes"] = len(_processes_under(data_dir))

    settings = load_settings(data_dir=data_dir)
    earlier = "ns_x_r0/abc/00_g0/left-by-an-earlier-run.bin"
    store, server = open_object_store(settings, subprefix=DEMO_PREFIX)
    store.put(earlier, b"an earlier demo's chunk")
    store.close()
    assert server is not None
    server.stop()
    report = run_demo(settings, SMALL, say=lambda _: None, hold=while_up)

    assert seen["stats_keys"] > 0 and seen["processes"] >= 2  # weed + vLLM were running
    assert len(report.turns) == SMALL.conversations * SMALL.turns
    # Second turns reuse the history: caches served part of them (not always all: a turn can come back
    # while its first turn's KV is still on its way to the tiers).
    assert sum(r.cached_tokens or 0 for r in report.turns if r.turn == 1) > 0
    # The returning user's prompt was pushed out of the engine and the CPU tier, and came back from ours.
    assert report.returning_hit_tokens > 0
    assert report.token_sources["disk"] > 0
    assert report.kvstore_tiers["nvme"].hits > 0
    assert report.returning_recompute_s > 0 and report.returning_hit_s > 0
    # A new node with an empty NVMe cache got each returning user's chunks from the bucket.
    users = SMALL.new_node_users
    assert len(report.new_node_hits_s) == len(report.new_node_recomputes_s) == users
    assert report.new_node_tiers["object"].hits >= users and report.new_node_hit_tokens > 0
    assert report.new_node_recompute_s > 0 and report.new_node_hit_s > 0
    # The new node's request, phase by phase from the tier's timeline: it went to the bucket.
    phases = {phase.name: phase for phase in report.new_node_phases}
    got = phases["all GETs returned"]
    assert 0 < got.start_ms <= got.end_ms <= report.new_node_hit_s * 1000

    store, server = open_object_store(settings, subprefix=DEMO_PREFIX)
    try:
        assert store.get(earlier) is None  # earlier runs' objects do not pile up on the node's own server
        assert any(True for _ in store.list())  # this run's stay, for the next run (or the user) to see
    finally:
        store.close()
        assert server is not None
        server.stop()
    assert _processes_under(data_dir) == []
    assert not new_shm(shm_before)


def test_ctrl_c_during_the_replay_stops_everything(data_dir: Path) -> None:
    shm_before = shm_snapshot()

    def interrupt(record: TurnRecord) -> None:
        raise KeyboardInterrupt

    settings = load_settings(data_dir=data_dir)
    with pytest.raises(KeyboardInterrupt):
        run_demo(settings, SMALL, say=lambda _: None, on_turn=interrupt)

    assert _processes_under(data_dir) == []
    assert not new_shm(shm_before)


def test_a_request_gets_its_own_phases_when_the_one_before_is_written_late(tmp_path: Path) -> None:
    now = [1.0]
    timeline = Timeline(tmp_path / "timeline.jsonl", clock=lambda: now[0], cpu_clock=lambda: now[0])
    timeline.begin("recomputed")  # the request before, answered at 2.0
    now[0] = 5.01
    timeline.begin("from the bucket")  # sent at 5.0
    now[0] = 5.2
    timeline.end("recomputed")  # vLLM reported it finished only now, during the next request's steps
    now[0] = 5.3
    timeline.end("from the bucket")
    phases = {phase.name: phase for phase in _phases(timeline.path, 5.0, 5.4)}
    assert phases["scheduler's first lookups"].end_ms == pytest.approx(10.0)
