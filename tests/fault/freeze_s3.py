"""Freeze the S3 server (SIGSTOP) for a while and measure what callers see. Run by hand, not by pytest:

    .venv/bin/python tests/fault/freeze_s3.py --stops 10,60,100 [--json out.json]

A private SeaweedFS holds chunks written by one node; a second node (its own empty NVMe cache) and a real
admin service (uvicorn, HTTP) serve from it. While the server is stopped, workers call in a loop: store GETs,
HEADs, PUTs, listings; the engine's loads (object GETs through the tier's read path) and lookups; `/healthz`
and `/v1/stats`. Each call's wait is recorded, and every byte an engine load returns is compared with what
was stored. After SIGCONT: how long until a GET works again.

Reported per stop: the longest wait of each kind of call (calls from the stop until a GET works again),
calls that waited more than 15 s (hangs: longer than any deadline), wrong bytes served, 5xx answers, and
whether a credential appeared in any answer or error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client import CollectorRegistry

from kvstore.admin.app import create_app
from kvstore.agent.uploads import wait_uploaded
from kvstore.config import load_settings
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace, make_offload_key
from kvstore.metrics import EngineMetrics
from kvstore.ports import free_port
from kvstore.runtime import Node, open_node
from kvstore.stores.embedded import SeaweedServer

HANG_S = 15.0  # longer than any deadline of the store (5 s data path, about 11 s control path)
CHUNK = 256 << 10


class Recorder:
    def __init__(self, secrets: list[str]) -> None:
        self._lock = threading.Lock()
        self.waits: dict[str, list[float]] = defaultdict(list)
        self.outcomes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.wrong_bytes = 0
        self.http_5xx = 0
        self.leaks = 0
        self._secrets = secrets

    def call(self, kind: str, fn: Callable[[], str]) -> None:
        began = time.monotonic()
        try:
            outcome = fn()
        except KVStoreError as exc:
            outcome = type(exc).__name__
            self.check_text(str(exc))
        except Exception as exc:  # anything else raised into a caller is a finding of its own
            outcome = f"raised {type(exc).__name__}"
            self.check_text(str(exc))
        took = time.monotonic() - began
        with self._lock:
            self.waits[kind].append(took)
            self.outcomes[kind][outcome] += 1

    def check_text(self, text: str) -> None:
        if any(s and s in text for s in self._secrets):
            with self._lock:
                self.leaks += 1

    def summary(self) -> dict[str, Any]:
        return {
            kind: {
                "calls": len(waits),
                "max_wait_s": round(max(waits), 2),
                "hangs_over_15s": sum(1 for w in waits if w > HANG_S),
                "outcomes": dict(self.outcomes[kind]),
            }
            for kind, waits in sorted(self.waits.items())
        }


def _node(server: SeaweedServer, bucket: str, cache_dir: Path, token: str) -> Node:
    settings = load_settings(
        store_url=f"s3://{bucket}",
        s3_endpoint=server.endpoint,
        access_key=server.access_key,
        secret_key=server.secret_key,
        cache_dir=cache_dir,
        cache_bytes=256 << 20,
        admin_token=token,
    )
    return open_node(settings, metrics=EngineMetrics(CollectorRegistry()), check_store=False)


def _workers(
    rec: Recorder,
    reader: Node,
    keys: list[str],
    raw: dict[str, bytes],
    base: str,
    token: str,
    stop: threading.Event,
) -> list[threading.Thread]:
    store = reader.store
    auth = {"Authorization": f"Bearer {token}"}
    counter = iter(range(10**9))

    def get() -> str:
        return "ok" if store.get(keys[next(counter) % len(keys)]) is not None else "missing"

    def head() -> str:
        return "ok" if all(store.exists_many(keys[:8])) else "missing"

    def put() -> str:
        store.put(f"freeze/put-{next(counter)}", b"x" * 4096)
        return "ok"

    def listing() -> str:
        sum(1 for _ in store.list("freeze/"))
        return "ok"

    def load() -> str:
        # A key this node has not loaded yet, so the read goes to the object store, not to its NVMe.
        key = keys[next(counter) % len(keys)]
        with contextlib.suppress(KVStoreError):
            reader.cache.discard(key)
        buf = bytearray(len(raw[key]))
        ok = reader.engine.load_into([(key, memoryview(buf))])[0]
        if ok and bytes(buf) != raw[key]:
            rec.wrong_bytes += 1
            return "WRONG BYTES"
        return "hit" if ok else "miss"

    def lookup() -> str:
        fresh = [f"{keys[0].rsplit('/', 1)[0]}/{next(counter):064x}.bin"]
        return str(reader.engine.lookup(fresh, wait=True)[0].name)

    def http(path: str) -> Callable[[], str]:
        def call() -> str:
            answer = httpx.get(f"{base}{path}", headers=auth, timeout=300)
            rec.check_text(answer.text)
            if answer.status_code >= 500 and not (path == "/healthz" and answer.status_code == 503):
                rec.http_5xx += 1
            return str(answer.status_code)

        return call

    kinds: dict[str, Callable[[], str]] = {
        "store GET": get,
        "store HEAD x8": head,
        "store PUT": put,
        "store LIST": listing,
        "engine load (object store)": load,
        "engine lookup (probe)": lookup,
        "GET /healthz": http("/healthz"),
        "GET /v1/stats": http("/v1/stats"),
    }

    def loop(kind: str, fn: Callable[[], str]) -> None:
        while not stop.is_set():
            rec.call(kind, fn)
            time.sleep(0.05)

    return [threading.Thread(target=loop, args=item, daemon=True) for item in kinds.items()]


def run(stops: list[float]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvstore-freeze-") as tmp:
        root = Path(tmp)
        server = SeaweedServer(root / "s3")
        server.start()
        token = "freeze-test-admin-token-" + os.urandom(6).hex()
        try:
            bucket = "freeze"
            with server.store(bucket) as s:
                s.create_bucket()
            ns = Namespace(model_name="freeze/model", tokens_per_hash=16, dtype="bfloat16")
            keys = [ns.chunk_key(make_offload_key(i.to_bytes(32, "big"))) for i in range(64)]
            raw = {k: os.urandom(CHUNK) for k in keys}
            writer = _node(server, bucket, root / "cache-writer", token)
            writer.engine.store_many(list(raw.items()))
            assert wait_uploaded(writer.engine.cache, 60), "the writer's uploads did not finish"
            writer.close()
            reader = _node(server, bucket, root / "cache-reader", token)
            port = free_port()
            app = create_app(reader)
            config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
            web = uvicorn.Server(config)
            threading.Thread(target=web.run, daemon=True).start()
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                        break
                assert time.monotonic() < deadline, "the admin service did not come up"
                time.sleep(0.1)
            assert server.pid is not None
            for seconds in stops:
                rec = Recorder([server.secret_key, server.access_key, token])
                stop = threading.Event()
                threads = _workers(rec, reader, keys, raw, base, token, stop)
                os.killpg(server.pid, signal.SIGSTOP)
                frozen_at = time.monotonic()
                for t in threads:
                    t.start()
                time.sleep(seconds)
                os.killpg(server.pid, signal.SIGCONT)
                thawed_at = time.monotonic()
                recovered = None
                while recovered is None and time.monotonic() - thawed_at < 120:
                    with contextlib.suppress(KVStoreError):
                        if reader.store.get(keys[0]) is not None:
                            recovered = time.monotonic() - thawed_at
                    time.sleep(0.05)
                stop.set()
                for t in threads:
                    t.join(300)
                stuck = sum(1 for t in threads if t.is_alive())
                results[f"{seconds:g} s"] = {
                    "frozen_s": round(thawed_at - frozen_at, 1),
                    "calls": rec.summary(),
                    "wrong_bytes_served": rec.wrong_bytes,
                    "http_5xx_other_than_healthz_503": rec.http_5xx,
                    "secrets_in_answers_or_errors": rec.leaks,
                    "recovered_after_s": None if recovered is None else round(recovered, 2),
                    "workers_still_stuck": stuck,
                }
                print(json.dumps({f"{seconds:g} s": results[f"{seconds:g} s"]}, indent=1), flush=True)
                time.sleep(3)  # let the node's breaker and caches settle before the next stop
            web.should_exit = True
            reader.close()
        finally:
            with contextlib.suppress(ProcessLookupError):
                if server.pid is not None:
                    os.killpg(server.pid, signal.SIGCONT)
            server.stop(kill=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--stops", default="10,60,100", help="seconds the server stays stopped, comma-separated"
    )
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    results = run([float(s) for s in args.stops.split(",")])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
