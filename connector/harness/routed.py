"""The multi-turn replay (`harness.multiturn`) across several vLLM servers, a router choosing each turn's.

Same workload, texts and client as `multiturn.replay`: every conversation active at once, `concurrency`
requests in flight in all, streamed chat completions. Before each turn is sent (once it holds a slot, as a
router dispatches it), the router picks the server:

- `RoundRobin`: a conversation's turns alternate between the servers, each conversation starting one further
  on, so the load is even and no turn lands where the previous one did;
- `CacheAware`: the prompt's exact token ids (the chat rendered and tokenized as the servers do it, or a
  server's `/tokenize` of the same messages) go to a KV indexer, and each server's cost is what Dynamo's
  router charges it: the prompt blocks it would have to prefill (those it is not credited with, tiers
  weighted as Dynamo weighs them, `weighted_blocks`) plus the blocks of the requests it is already serving;
  the cheapest wins, ties round-robin. Credit alone sends every turn of a conversation back to one node
  however busy it is; load alone is round-robin.

A turn's TTFT is the client's: routing time (tokenizing, asking the indexer) plus the server's time to its
first token; `RoutedTurn.route_s` keeps the routing part.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import httpx

from kvstore.connector.harness.multiturn import (
    Clock,
    History,
    TurnRecord,
    Workload,
    chat_turn,
    client_for,
    conversation_scripts,
    converse,
)
from kvstore.connector.harness.router import Credit, DynamoIndexer

__all__ = [
    "DISK_WEIGHT",
    "HOST_WEIGHT",
    "CacheAware",
    "RoundRobin",
    "Route",
    "RoutedTurn",
    "Router",
    "local_chat_tokenizer",
    "replay_routed",
    "routing_costs",
    "tokenize_chat",
    "weighted_blocks",
]

# Dynamo's router (1.6): a block the worker holds on its device counts 1 (overlap_score_credit), one beyond
# those in host memory host_cache_hit_weight, one beyond those on disk disk_cache_hit_weight (its defaults).
HOST_WEIGHT = 0.75
DISK_WEIGHT = 0.25

_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
Messages = Sequence[Mapping[str, str]]


def weighted_blocks(
    credit: Credit, block_size: int, *, host: float = HOST_WEIGHT, disk: float = DISK_WEIGHT
) -> float:
    """The blocks Dynamo's router credits a worker with for a prompt. The indexer's counts are cumulative
    (cpu includes gpu, disk includes cpu); the router weighs each tier's blocks beyond the tier above."""
    device = credit.gpu // block_size
    on_host = max(0, credit.cpu - credit.gpu) // block_size
    on_disk = max(0, credit.disk - max(credit.cpu, credit.gpu)) // block_size
    return device + host * on_host + disk * on_disk


def routing_costs(blocks: int, credited: Sequence[float], active: Sequence[int]) -> tuple[float, ...]:
    """Each server's cost for a prompt of `blocks` blocks, as Dynamo's router reckons it (overlap weight 1):
    the blocks it would prefill (those it is not `credited` with) plus the blocks it is serving (`active`)."""
    return tuple(max(0.0, blocks - c) + a for c, a in zip(credited, active, strict=True))


@dataclass(frozen=True)
class Route:
    """A router's choice for one turn, and what it was based on."""

    server: int
    scores: tuple[float, ...] = ()  # per server, for routers that score (weighted blocks credited)
    costs: tuple[float, ...] = ()  # per server, for routers that weigh load too (blocks to prefill + active)
    blocks: int = 0  # the prompt's blocks, charged to the chosen server while the turn runs
    tied: bool = False  # the best score was shared: the round-robin tie-break chose
    prompt_tokens: int | None = None  # tokens the router scored, for routers that tokenize
    tokenize_s: float = 0.0  # of the routing time: tokenizing the prompt
    query_s: float = 0.0  # ... and asking the indexer


@dataclass(frozen=True)
class RoutedTurn:
    record: TurnRecord  # TTFT and latency as the client saw them, routing included
    server: int
    route_s: float
    route: Route


class Router(Protocol):
    async def choose(
        self, conversation: int, turn: int, messages: Messages, clients: Sequence[httpx.AsyncClient]
    ) -> Route: ...

    def finished(self, route: Route) -> None:
        """The turn sent by ``route`` has its answer: its server is that much less loaded."""

    async def aclose(self) -> None: ...


class RoundRobin:
    def __init__(self, servers: int) -> None:
        self._servers = servers

    async def choose(
        self, conversation: int, turn: int, messages: Messages, clients: Sequence[httpx.AsyncClient]
    ) -> Route:
        return Route((conversation + turn) % self._servers)

    def finished(self, route: Route) -> None:
        pass

    async def aclose(self) -> None:
        pass


class CacheAware:
    """Ask `indexer` what each of `instances` (one id per server, in server order) holds of the prompt, and
    send it where prefilling the rest costs least beside the work already there.

    `tokenize` renders and tokenizes the chat as the servers do (`local_chat_tokenizer`), as a router in
    front of the engines does; without it a server's `/tokenize` does (exact by construction, but a round
    trip through a busy server's API process)."""

    def __init__(
        self,
        indexer: DynamoIndexer,
        instances: Sequence[int],
        *,
        model: str,
        block_size: int,
        tokenize: Callable[[Messages], list[int]] | None = None,
    ) -> None:
        self._indexer = indexer
        self._instances = list(instances)
        self._model = model
        self._block_size = block_size
        self._tokenize = tokenize
        self._ties = itertools.count()
        self._client: httpx.AsyncClient | None = None
        self._active = [0] * len(self._instances)  # prompt blocks of the turns each server is serving

    async def choose(
        self, conversation: int, turn: int, messages: Messages, clients: Sequence[httpx.AsyncClient]
    ) -> Route:
        start = time.perf_counter()
        if self._tokenize is not None:
            tokens = self._tokenize(messages)
        else:  # any server tokenizes the same; spread the work as round-robin would
            tokens = await tokenize_chat(clients[(conversation + turn) % len(clients)], self._model, messages)
        tokenized = time.perf_counter()
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=_TIMEOUT)
        credits = await self._indexer.query(self._client, tokens, model=self._model)
        timing = {"tokenize_s": tokenized - start, "query_s": time.perf_counter() - tokenized}
        scores = tuple(
            weighted_blocks(credits.get(instance, Credit()), self._block_size) for instance in self._instances
        )
        blocks = -(-len(tokens) // self._block_size)
        costs = routing_costs(blocks, scores, self._active)
        best = min(costs)
        leaders = [i for i, cost in enumerate(costs) if cost == best]
        tied = len(leaders) > 1
        server = leaders[next(self._ties) % len(leaders)] if tied else leaders[0]
        self._active[server] += blocks
        return Route(server, scores, costs, blocks, tied=tied, prompt_tokens=len(tokens), **timing)

    def finished(self, route: Route) -> None:
        self._active[route.server] -= route.blocks

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def local_chat_tokenizer(model_dir: Path) -> Callable[[Messages], list[int]]:
    """The prompt token ids vLLM builds for a chat completion, computed here: the model's chat template
    rendered with the generation prompt, then tokenized without adding special tokens (what vLLM's chat
    preprocessing does; a run counts the turns where the server's count differs)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def tokenize(messages: Messages) -> list[int]:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
        )
        return [int(t) for t in tokenizer.encode(str(text), add_special_tokens=False)]

    return tokenize


async def tokenize_chat(client: httpx.AsyncClient, model: str, messages: Messages) -> list[int]:
    """The prompt token ids the server builds from `messages` for a chat completion (template included)."""
    body = {"model": model, "messages": list(messages), "add_generation_prompt": True}
    response = await client.post("/tokenize", json=body)
    response.raise_for_status()
    return [int(t) for t in response.json()["tokens"]]


async def replay_routed(
    server_urls: Sequence[str],
    model: str,
    workload: Workload,
    router: Router,
    on_turn: Callable[[RoutedTurn], None] | None = None,
) -> list[RoutedTurn]:
    """Run every conversation of `workload`, each turn on the server `router` picks; turns in completion
    order. Texts are sized by the first server's tokenizer before the first request."""
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(client_for(url, workload)) for url in server_urls]
        scripts = await conversation_scripts(clients[0], model, workload)

        async def send(
            conversation: int, turn: int, messages: History, elapsed: Clock
        ) -> tuple[str, RoutedTurn]:
            # Routed once the turn holds a slot, as a router dispatches it; the client waits for both.
            start = time.perf_counter()
            route = await router.choose(conversation, turn, messages, clients)
            route_s = time.perf_counter() - start
            try:
                answer, record = await chat_turn(
                    clients[route.server], model, messages, workload, conversation, turn
                )
            finally:
                router.finished(route)
            record = replace(
                record,
                ttft_s=record.ttft_s + route_s,
                latency_s=record.latency_s + route_s,
                finished_s=elapsed(),
            )
            return answer, RoutedTurn(record, route.server, route_s, route)

        try:
            return await converse(scripts, workload.concurrency, send, on_turn)
        finally:
            await router.aclose()
