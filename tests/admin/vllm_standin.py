"""A small HTTP server that answers the three vLLM OpenAI calls the admin service makes, for API tests.

It listens on 127.0.0.1 like a real server, so the service under test makes real HTTP requests to a URL of
its `vllm_urls` setting. `/tokenize` tokenizes with the tiny model's real tokenizer and chat template (what
vLLM serving that model answers; `tests/connector/test_warm_vllm.py` checks the service against vLLM itself).
`/v1/completions` calls `on_prefill(token_ids)`, which a test uses to store chunks as a tier would. Every
request is recorded; `refuse_with` makes every answer that HTTP status with a body the service must not pass
on.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvstore.prompts import tokens_from_messages, tokens_from_prompt

SECRET_ANSWER = "internal detail the admin service must never echo"


class VLLMStandIn:
    def __init__(self, model_dir: Path, *, served: str = "tiny", root: str | None = None) -> None:
        self.model_dir = model_dir
        self.served = served
        self.root = root if root is not None else str(model_dir)
        self.requests: list[tuple[str, dict[str, Any] | None]] = []
        self.on_prefill: Callable[[list[int]], None] = lambda tokens: None
        self.refuse_with: int | None = None
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                standin.requests.append((f"GET {self.path}", None))
                if standin.refuse_with is not None:
                    self._answer(standin.refuse_with, {"message": SECRET_ANSWER})
                elif self.path == "/v1/models":
                    self._answer(200, {"data": [{"id": standin.served, "root": standin.root}]})
                else:
                    self._answer(404, {"message": "no such route"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
                standin.requests.append((f"POST {self.path}", body))
                if standin.refuse_with is not None:
                    self._answer(standin.refuse_with, {"message": SECRET_ANSWER})
                elif body.get("model") != standin.served:
                    self._answer(404, {"message": f"model {body.get('model')!r} does not exist"})
                elif self.path == "/tokenize":
                    self._answer(200, {"tokens": standin.tokenize(body)})
                elif self.path == "/v1/completions":
                    standin.on_prefill(list(body["prompt"]))
                    self._answer(200, {"choices": [{"text": "x"}]})
                else:
                    self._answer(404, {"message": "no such route"})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def tokenize(self, body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            return tokens_from_messages(
                self.model_dir,
                body["messages"],
                add_generation_prompt=body.get("add_generation_prompt", True),
            )
        return tokens_from_prompt(
            self.model_dir, body["prompt"], add_special_tokens=body.get("add_special_tokens", True)
        )

    def calls(self, route: str) -> list[dict[str, Any] | None]:
        return [body for name, body in self.requests if name == route]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
