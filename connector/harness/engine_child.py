"""The subprocess side of `engine_runner`: build a vLLM engine from ``<work>/spec.json``, run its prompts
one ``generate`` call at a time, and write ``<work>/result.json`` (outputs, KV digests, metrics, KV events).

Run as a script (``python engine_child.py <work>``) in a process of its own, with vLLM's engine core inside
it; it imports vLLM, and torch through it, only there.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def _flat_metrics(metrics: list[Any]) -> dict[str, float]:
    """Flatten vLLM's metric snapshot (Counter/Gauge/Histogram/Vector) to name{labels}."""
    flat: dict[str, float] = {}
    for m in metrics:
        labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()))
        key = f"{m.name}{{{labels}}}" if labels else m.name
        kind = type(m).__name__
        if kind == "Histogram":
            flat[key.replace(m.name, m.name + "_count", 1)] = float(m.count)
            flat[key.replace(m.name, m.name + "_sum", 1)] = float(m.sum)
        elif kind == "Vector":
            for i, v in enumerate(m.values):
                flat[key.replace(m.name, f"{m.name}[{i}]", 1)] = float(v)
        else:
            flat[key] = float(m.value)
    return flat


def _declared_metric_names() -> list[str]:
    """Every vLLM metric the process registry declares, as `_flat_metrics` names them."""
    from prometheus_client import REGISTRY

    names: list[str] = []
    for family in REGISTRY.collect():
        if not family.name.startswith("vllm:"):
            continue
        names.append(family.name)
        if family.type == "histogram":
            names += [f"{family.name}_count", f"{family.name}_sum"]
    return names


class _BlockRecorder:
    """Which KV-cache blocks each request holds, and a digest of what the engine keeps in them.

    Instruments the in-process engine (the harness runs the engine core and the worker in this process):
    `KVCacheManager.allocate_slots` is wrapped to note each request's block ids after every allocation,
    and the `CPUCopyWorker` (our spec's worker) is noted when built, for its per-tensor block views
    (``(num_blocks, page_bytes)`` over the engine's KV cache, the exact bytes a tier stores and loads)."""

    def __init__(self) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        from kvstore.connector import cpu

        self.blocks: dict[str, list[int]] = {}
        self.workers: list[Any] = []
        allocate = KVCacheManager.allocate_slots
        worker_init = cpu.CPUCopyWorker.__init__
        recorder = self

        def allocate_slots(manager: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            blocks = allocate(manager, request, *args, **kwargs)
            if blocks is not None:
                recorder.blocks[request.request_id] = list(manager.get_block_ids(request.request_id)[0])
            return blocks

        def init(worker: Any, *args: Any, **kwargs: Any) -> None:
            worker_init(worker, *args, **kwargs)
            recorder.workers.append(worker)

        setattr(KVCacheManager, "allocate_slots", allocate_slots)  # noqa: B010 - instrumentation
        setattr(cpu.CPUCopyWorker, "__init__", init)  # noqa: B010 - instrumentation

    def digests(self, request_ids: list[str], num_blocks: int) -> list[str]:
        import hashlib

        if len(self.workers) != 1:
            raise RuntimeError(f"kv_digests needs CPUTieringSpec's worker; found {len(self.workers)}")
        if len(request_ids) != 1:
            raise RuntimeError(f"expected one new request per generate, got {request_ids}")
        block_ids = self.blocks[request_ids[0]][:num_blocks]
        if len(block_ids) < num_blocks:
            raise RuntimeError(f"request holds {len(block_ids)} blocks, expected {num_blocks}")
        pairs = self.workers[0]._pairs
        out = []
        for block in block_ids:
            h = hashlib.sha256()
            for pair in pairs:
                h.update(pair.device[block].contiguous().numpy().tobytes())
            out.append(h.hexdigest())
        return out


class _EventCollector:
    """Subscribes to vLLM's KV-event publisher and decodes each ``KVEventBatch``.

    Wire format: multipart ``[topic, seq (8 bytes, big endian), msgpack(KVEventBatch)]``;
    the batch is array-like ``[ts, events, data_parallel_rank]`` and each event a tagged map.
    """

    def __init__(self, endpoint: str) -> None:
        import threading

        import zmq

        self.events: list[dict[str, Any]] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        while not self._stop.is_set():
            if not self._sock.poll(100, zmq.POLLIN):
                continue
            _topic, _seq, payload = self._sock.recv_multipart()
            batch = decoder.decode(payload)
            for event in batch.events:
                raw = msgspec.to_builtins(event)
                raw["type"] = type(event).__name__
                self.events.append(raw)

    def close(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()
        return self.events


def _child(work: Path) -> None:
    spec = json.loads((work / "spec.json").read_text())
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "dtype": "bfloat16",
        "enforce_eager": True,
        "max_model_len": spec["max_model_len"],
        "max_num_seqs": 4,
        "max_num_batched_tokens": spec["max_model_len"],
        "kv_cache_memory_bytes": spec["kv_cache_bytes"],
        "seed": 0,
        "disable_log_stats": False,
        "enable_prefix_caching": True,
        # One process instead of three (front end, engine core, worker): each would import
        # vLLM again (~6 s apiece on these machines).
        "distributed_executor_backend": "uni",
    }
    if spec["kv_transfer_config"] is not None:
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    collector: _EventCollector | None = None
    if spec["capture_kv_events"]:
        endpoint = f"ipc://{work / 'tmp' / 'kv-events.sock'}"
        kwargs["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            **(spec["kv_events_config"] or {}),
        }
        collector = _EventCollector(endpoint)
    elif spec["kv_events_config"] is not None:
        kwargs["kv_events_config"] = spec["kv_events_config"]
    kwargs.update(spec["engine_args"])
    recorder = _BlockRecorder() if spec["kv_digests"] else None
    llm = LLM(**kwargs)
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    start_s = time.perf_counter() - t0

    params = SamplingParams(
        temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=spec["logprobs"]
    )
    results: list[dict[str, Any]] = []
    generate_s: list[float] = []
    generate_at: list[tuple[float, float]] = []  # monotonic start and end: tier timelines use that clock
    for i, prompt in enumerate(spec["prompts"]):
        if i:
            time.sleep(spec["pause_s"])
            if spec["between"]:
                (work / f"paused_{i - 1}").touch()
                while not (work / f"resume_{i - 1}").exists():
                    time.sleep(0.05)
        p = TokensPrompt(prompt_token_ids=prompt) if isinstance(prompt, list) else prompt
        known = set(recorder.blocks) if recorder is not None else set()
        m0, g0 = time.monotonic(), time.perf_counter()
        (out,) = llm.generate([p], params, use_tqdm=False)
        generate_s.append(time.perf_counter() - g0)
        generate_at.append((m0, time.monotonic()))
        prompt_len = len(out.prompt_token_ids or [])
        digests = None
        if recorder is not None:  # read now: the next request may take these blocks
            new = [r for r in recorder.blocks if r not in known]
            digests = recorder.digests(new, prompt_len // block_size)
        results.append(
            {
                "prompt_len": prompt_len,
                "num_cached_tokens": int(out.num_cached_tokens or 0),
                "token_ids": list(out.outputs[0].token_ids),
                "text": out.outputs[0].text,
                "logprobs": (
                    [{tid: lp.logprob for tid, lp in pos.items()} for pos in out.outputs[0].logprobs]
                    if out.outputs[0].logprobs is not None
                    else None
                ),
                "kv_digests": digests,
            }
        )
    time.sleep(spec["settle_s"])
    # No fallback: a run whose metrics cannot be read must fail, not report every metric as 0.
    metrics = _flat_metrics(llm.get_metrics())
    metric_names = _declared_metric_names()
    events = collector.close() if collector is not None else []
    (work / "result.json").write_text(
        json.dumps(
            {
                "results": results,
                "metrics": metrics,
                "metric_names": metric_names,
                "start_s": start_s,
                "generate_s": generate_s,
                "generate_at": generate_at,
                "kv_events": events,
            },
            default=repr,
        )
    )
    del llm  # orderly shutdown: tiers drain, the engine core exits and unlinks its region


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
