"""Warming and pinning against a real vLLM OpenAI server (CPU backend, tiny model) with our tier on a real
bucket: the library call, and the admin service tokenizing through the engine's own `/tokenize`.

The server runs through `connector/harness/vllm_server.py` (its own process group and TMPDIR; the group is
killed and its /dev/shm entries removed at the end, whatever happens). A server that does not come up within
a generous deadline (`KVSTORE_TEST_VLLM_START_S`, default 600 s) fails the test with its log tail: a slow or
hung start is a finding, never a skip. The same server is the harness's real-server test (a server start is
the cost): it answers a completion with usage details and metrics first, and leaves no process, temp dir or
/dev/shm entry behind when the block exits on an exception (`tests/connector/harness/test_vllm_server.py` has
the failed start).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvstore.admin.app import create_app
from kvstore.connector.configs import cpu_tiering_config
from kvstore.connector.harness.engine_runner import new_shm, shm_snapshot
from kvstore.connector.harness.tiny_model import sample_text
from kvstore.connector.harness.vllm_server import VLLMServer, VLLMServerError, metric_total, vllm_server
from kvstore.key_scheme import namespace_schemes, scheme_for
from kvstore.layout import CONFIG_FILENAME
from kvstore.pins import load_namespace
from kvstore.prompts import tokens_from_messages, tokens_from_prompt
from kvstore.runtime import Node
from kvstore.warm import warm
from tests.helpers import require_vllm, wait_job, wait_value

require_vllm()

pytestmark = pytest.mark.vllm

START_TIMEOUT_S = float(os.environ.get("KVSTORE_TEST_VLLM_START_S", "600"))
_ARGS = ["--enforce-eager", "--max-model-len", "8192", "--max-num-seqs", "4"]


class _Stop(Exception):
    """Raised at the end of the server block: the harness must clean up on the way out of an exception."""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def served(
    model: Path,
    tier: dict[str, Any],
    env: dict[str, str],
    log: Path | None = None,
    *,
    timeout_s: float = START_TIMEOUT_S,
) -> Iterator[VLLMServer]:
    """A vLLM server with `tier` behind it (logging to `log`, or to a file in its temp dir); a start that
    fails or takes longer than `timeout_s` fails the test with the server's log tail."""
    try:
        with vllm_server(
            model,
            kv_transfer_config=cpu_tiering_config(tier),
            env={"VLLM_CPU_KVCACHE_SPACE": "1", **env},
            extra_args=_ARGS,
            log_path=log,
            startup_timeout_s=timeout_s,
        ) as server:
            yield server
    except VLLMServerError as exc:
        pytest.fail(f"the vLLM server did not come up within {timeout_s:.0f} s:\n{exc}", pytrace=False)


def test_a_server_that_does_not_come_up_fails_the_test_with_its_log(tiny_model: Path, tmp_path: Path) -> None:
    tier = {"type": "KVStoreTier", "module_path": "kvstore.connector.tier", "store_url": "memory://x"}
    with (
        pytest.raises(pytest.fail.Exception) as failed,
        served(tiny_model, tier, {}, tmp_path / "s.log", timeout_s=1),
    ):
        pytest.fail("the server cannot be up after one second")  # pragma: no cover
    assert "did not come up within 1 s" in str(failed.value) and "not healthy in time" in str(failed.value)


def test_warm_and_pin_through_the_engine(
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
    shm_before = shm_snapshot()
    with pytest.raises(_Stop), served(tiny_model, tier, creds) as server:
        pgid, log_path = server.process.pid, server.log_path
        _answers_with_usage_and_metrics(server, tiny_model)
        configs = [o.key for o in s3_store.list() if o.key.endswith("/" + CONFIG_FILENAME)]
        assert len(configs) == 1, configs  # the tier published its namespace at start-up
        namespace = configs[0].split("/", 1)[0]
        node = open_test_node(
            s3_server,
            store_url,
            cache_dir=tmp_path / "nvme-admin",
            cache_bytes=64 << 20,
            admin_token="t",
            vllm_urls=[server.base_url],
        )
        # ... and recorded how its engine hashes: vLLM's default algorithm and the seed of this environment.
        ns = load_namespace(node.store, namespace)
        recorded = wait_value(lambda: namespace_schemes(node.store, ns), what="the engine's key scheme")
        assert recorded == [scheme_for("sha256", os.environ.get("PYTHONHASHSEED"))]

        report = warm(node, namespace, tokens, vllm_url=server.base_url, poll_s=20.0, timeout_s=60.0)
        assert report.total == len(tokens) // 128, report
        assert report.still_missing == 0 and report.produced == report.total, report
        again = warm(node, namespace, tokens, vllm_url=server.base_url, prefetch=True)
        assert again.produced == 0 and again.still_missing == 0
        assert again.already_local + again.prefetched == again.total, again

        # The admin service: the prompt and the chat messages are tokenized by this engine, and the chunks
        # its prefill stores are exactly the ones the service named.
        client = TestClient(create_app(node), headers={"Authorization": "Bearer t"})
        prompt = sample_text(1500, seed=9)
        body = {"namespace": namespace, "served_model": server.model, "prompt": prompt, "poll_s": 20}
        job = wait_job(client, client.post("/v1/warm", json=body).json()["id"], timeout=180)
        assert job["status"] == "done", job
        result = job["result"]
        assert result["total"] >= 8 and result["produced"] == result["total"] and result["errors"] == [], job
        pin = client.post(
            "/v1/pins",
            json={"name": "prompt", "namespace": namespace, "served_model": server.model, "prompt": prompt},
        )
        assert pin.status_code == 201, pin.text
        assert pin.json()["present_chunks"] == len(pin.json()["keys"]) == result["total"]
        assert pin.json()["num_tokens"] == len(tokens_from_prompt(tiny_model, prompt))

        system = [{"role": "system", "content": sample_text(1400, seed=11)}]
        chat = client.post(
            "/v1/pins",
            json={"name": "system", "namespace": namespace, "served_model": server.model, "messages": system},
        )
        assert chat.status_code == 201, chat.text
        assert chat.json()["num_tokens"] == len(tokens_from_messages(tiny_model, system))
        job = wait_job(
            client,
            client.post("/v1/warm", json={"namespace": namespace, "messages": system, "poll_s": 20}).json()[
                "id"
            ],
            timeout=180,
        )
        assert job["result"]["still_missing"] == 0 and job["result"]["total"] == len(chat.json()["keys"]), job
        raise _Stop
    # Nothing of the server is left: its process group, its temp dir (the log in it), its /dev/shm entries.
    assert not _group_alive(pgid)
    assert not log_path.exists()
    assert not new_shm(shm_before)


def _answers_with_usage_and_metrics(server: VLLMServer, model: Path) -> None:
    """The harness's server, asked first: a completion with usage details, and metrics that counted it."""
    assert server.base_url.startswith("http://127.0.0.1:")
    assert server.model == model.name
    body = {"model": server.model, "prompt": "the cache of the model", "max_tokens": 4, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    answer = response.json()
    assert answer["usage"]["completion_tokens"] == 4
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # details are on by default
    metrics = server.metrics()
    assert metric_total(metrics, "vllm:prompt_tokens_total") == answer["usage"]["prompt_tokens"]
    assert metric_total(metrics, "vllm:request_success_total") == 1
