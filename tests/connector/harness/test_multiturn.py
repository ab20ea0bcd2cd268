"""The one replay loop (`converse`) that the single-server and the routed replays share, with a fake `send`:
histories, the bound on turns in flight, FIFO order between conversations, what is kept."""

from __future__ import annotations

import asyncio

from kvstore.connector.harness.multiturn import Clock, History, converse

SCRIPTS = [["a0", "a1", "a2"], ["b0", "b1", "b2"], ["c0", "c1", "c2"]]


def test_histories_order_and_the_bound_on_turns_in_flight() -> None:
    in_flight = peak = 0
    sent: list[tuple[int, int, list[str]]] = []
    seen: list[str] = []

    async def send(conversation: int, turn: int, messages: History, elapsed: Clock) -> tuple[str, str]:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        sent.append((conversation, turn, [m["content"] for m in messages]))
        await asyncio.sleep(0.001)
        in_flight -= 1
        assert elapsed() > 0
        return f"answer {conversation}.{turn}", f"{conversation}.{turn}"

    kept = asyncio.run(converse(SCRIPTS, 2, send, seen.append))

    assert peak == 2
    assert sorted(kept) == [f"{c}.{t}" for c in range(3) for t in range(3)] and seen == kept
    # Each turn sends the whole history: every earlier user message and answer, then its own message.
    for conversation, turn, contents in sent:
        history = [x for t in range(turn) for x in (SCRIPTS[conversation][t], f"answer {conversation}.{t}")]
        assert contents == [*history, SCRIPTS[conversation][turn]]


def test_a_conversation_queues_behind_all_the_others_after_each_turn() -> None:
    async def send(conversation: int, turn: int, messages: History, elapsed: Clock) -> tuple[str, int]:
        await asyncio.sleep(0)
        return "", conversation

    assert asyncio.run(converse(SCRIPTS, 1, send)) == [0, 1, 2] * 3
