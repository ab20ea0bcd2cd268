"""A multi-turn chat workload and an async HTTP client that replays it against a vLLM OpenAI server.

Each conversation opens with a long context and then, turn after turn, appends the model's answer and a
fixed number of new user tokens, resending the whole history each time, exactly as a chat client does. So
turn `t` of a conversation can reuse the KV of turn `t - 1` only if some cache still holds it when the
conversation comes back.

All conversations are active at once and every turn waits for a slot among `concurrency` (FIFO), so after
one of its turns a conversation queues behind all the others: between two turns of one conversation, every
other conversation sends a turn. The KV that must survive between turns is therefore that of all
conversations, which is what the number of conversations sweeps.

Texts are deterministic (`sample_text`) and sized in tokens by the server's own tokenizer (`/tokenize`,
`/detokenize`), before the measured phase. Requests stream (`/v1/chat/completions`), so TTFT is the time to
the first streamed token; the final usage chunk gives prompt and cached tokens (the server reports cached
tokens with `--enable-prompt-tokens-details`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import httpx

from kvstore.connector.harness.tiny_model import sample_text

__all__ = [
    "Clock",
    "History",
    "SendTurn",
    "TurnRecord",
    "Workload",
    "chat_turn",
    "client_for",
    "conversation_scripts",
    "converse",
    "replay",
]

_TIMEOUT = httpx.Timeout(600.0, connect=10.0)

T = TypeVar("T")
History = list[dict[str, str]]  # a conversation's history, as the chat API takes it
Clock = Callable[[], float]
# Sends one turn: (conversation, turn, history, clock) -> (the answer, what the caller keeps of the turn).
SendTurn = Callable[[int, int, History, Clock], Awaitable[tuple[str, T]]]


@dataclass(frozen=True)
class Workload:
    conversations: int
    context_tokens: int  # the opening user message
    turn_tokens: int  # new user tokens per later turn
    turns: int
    output_tokens: int  # answer length (EOS ignored, so every answer has this length)
    concurrency: int  # requests in flight at most
    seed: int = 0  # different seeds give different texts (no shared prefixes across runs)

    def warmup(self, seed: int) -> Workload:
        """Two short conversations with `seed` (one no measured replay uses): a fresh server's first requests
        pay one-off costs (allocations, warm-up paths) that no measurement should include."""
        return Workload(
            conversations=2,
            context_tokens=min(256, self.context_tokens),
            turn_tokens=min(64, self.turn_tokens),
            turns=2,
            output_tokens=self.output_tokens,
            concurrency=2,
            seed=seed,
        )


@dataclass(frozen=True)
class TurnRecord:
    conversation: int
    turn: int
    prompt_tokens: int  # as the server counted them (chat template included)
    cached_tokens: int | None  # from any cache (engine or connector); None if the server does not say
    ttft_s: float
    latency_s: float
    finished_s: float = 0.0  # when the turn finished, seconds since the replay's first request


async def replay(
    server_url: str,
    model: str,
    workload: Workload,
    on_turn: Callable[[TurnRecord], None] | None = None,
) -> list[TurnRecord]:
    """Run every conversation of `workload` against `server_url`; records in completion order."""
    async with client_for(server_url, workload) as client:
        scripts = await conversation_scripts(client, model, workload)

        async def send(
            conversation: int, turn: int, messages: History, elapsed: Clock
        ) -> tuple[str, TurnRecord]:
            answer, record = await chat_turn(client, model, messages, workload, conversation, turn)
            return answer, replace(record, finished_s=elapsed())

        return await converse(scripts, workload.concurrency, send, on_turn)


async def converse(
    scripts: Sequence[Sequence[str]],
    concurrency: int,
    send: SendTurn[T],
    on_turn: Callable[[T], None] | None = None,
) -> list[T]:
    """The replay loop: every conversation of `scripts` at once, at most `concurrency` turns in flight (FIFO).
    A turn appends its user message to its conversation's history, waits for a slot, and `send`s the history
    with a clock (seconds since the loop began), which answers with the assistant's text, appended next, and
    what the caller keeps of the turn. What `send` kept, in completion order."""
    slots = asyncio.Semaphore(concurrency)
    kept: list[T] = []
    began = time.perf_counter()

    def elapsed() -> float:
        return time.perf_counter() - began

    async def one(conversation: int) -> None:
        messages: History = []
        for turn, user_text in enumerate(scripts[conversation]):
            messages.append({"role": "user", "content": user_text})
            async with slots:
                answer, sent = await send(conversation, turn, messages, elapsed)
            messages.append({"role": "assistant", "content": answer})
            kept.append(sent)
            if on_turn is not None:
                on_turn(sent)

    await asyncio.gather(*(one(c) for c in range(len(scripts))))
    return kept


def client_for(server_url: str, workload: Workload) -> httpx.AsyncClient:
    """A client for one server, with a connection for every request in flight and a few to spare."""
    limits = httpx.Limits(max_connections=workload.concurrency + 4)
    return httpx.AsyncClient(base_url=server_url, timeout=_TIMEOUT, limits=limits)


async def conversation_scripts(client: httpx.AsyncClient, model: str, workload: Workload) -> list[list[str]]:
    """Every conversation's user messages, sized by the tokenizer of the server `client` talks to."""
    texts = _Texts(client, model)
    return [await _script(texts, workload, c) for c in range(workload.conversations)]


async def _script(texts: _Texts, workload: Workload, conversation: int) -> list[str]:
    """The user messages of one conversation: its context, then one message per later turn."""
    base = (workload.seed * 100_003 + conversation) * 1_000
    out = [await texts.sized(workload.context_tokens, seed=base)]
    for turn in range(1, workload.turns):
        out.append(await texts.sized(workload.turn_tokens, seed=base + turn))
    return out


class _Texts:
    """Deterministic text of an exact token count under the served model's tokenizer."""

    def __init__(self, client: httpx.AsyncClient, model: str) -> None:
        self._client = client
        self._model = model

    async def sized(self, tokens: int, *, seed: int) -> str:
        # Word salad runs ~1.1 tokens a word: 1 word per token overshoots, then cut at the token.
        text = str(sample_text(max(tokens, 8), seed=seed))
        ids = (await self._post("/tokenize", {"prompt": text, "add_special_tokens": False}))["tokens"]
        if len(ids) <= tokens:
            return text
        return str((await self._post("/detokenize", {"tokens": ids[:tokens]}))["prompt"])

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self._client.post(path, json={"model": self._model, **body})
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result


async def chat_turn(
    client: httpx.AsyncClient,
    model: str,
    messages: list[dict[str, str]],
    workload: Workload,
    conversation: int,
    turn: int,
) -> tuple[str, TurnRecord]:
    """One streamed chat completion: the answer text and what the turn cost."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": workload.output_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"chat completion failed ({response.status_code}): {detail[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if first is None:
                        first = time.perf_counter()
                    pieces.append(content)
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    record = TurnRecord(
        conversation=conversation,
        turn=turn,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=None if cached is None else int(cached),
        ttft_s=(first if first is not None else end) - start,
        latency_s=end - start,
    )
    return "".join(pieces), record
