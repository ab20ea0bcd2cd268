"""The tier's probe order: chains where vLLM scans a prefix, single keys where it does not."""

from __future__ import annotations

from kvstore.connector.probe_order import UnknownChunk, prefix_chains


def test_probe_chains_follow_vllm_scans() -> None:
    g0, g1 = (0).to_bytes(4, "big"), (1).to_bytes(4, "big")
    lookups = [
        UnknownChunk("a", g0, 16, "a0"),  # full attention: scanned from the start
        UnknownChunk("a", g0, 32, "a1"),
        UnknownChunk("a", g1, 32, "w1"),  # sliding window, same request: scanned from the end
        UnknownChunk("a", g1, 16, "w0"),
        UnknownChunk("b", g0, 16, "b0"),
        UnknownChunk("b", g0, 48, "b2"),
        UnknownChunk("c", g0, None, "c0"),  # no position recorded: nothing is assumed
        UnknownChunk("c", g0, None, "c1"),
    ]
    # A prefix run is one chain (cut at its first miss); any other run is asked key by key.
    assert prefix_chains(lookups).chains == [["a0", "a1"], ["w1"], ["w0"], ["b0", "b2"], ["c0"], ["c1"]]


def test_a_short_tail_after_a_held_beginning_is_asked_of_this_node_only() -> None:
    g0 = (0).to_bytes(4, "big")
    lookups = [
        UnknownChunk("turn", g0, 1152, "t8"),  # chunks 9-11 of a conversation: its new turn
        UnknownChunk("turn", g0, 1280, "t9"),
        UnknownChunk("turn", g0, 1408, "t10"),
        UnknownChunk("long", g0, 1152, "l8"),  # the same start, five chunks: longer than the tail
        *(UnknownChunk("long", g0, 1152 + 128 * i, f"l{8 + i}") for i in range(1, 5)),
        UnknownChunk("new", g0, 128, "n0"),  # a request whose beginning nobody holds: the bucket is asked
        UnknownChunk("new", g0, 256, "n1"),
    ]
    plan = prefix_chains(lookups, chunk_tokens=128, tail_tokens=384)
    assert plan.node_only == [["t8", "t9", "t10"]]
    assert plan.chains == [["l8", "l9", "l10", "l11", "l12"], ["n0", "n1"]]
    # Off (the default): every chain is asked of the bucket.
    assert prefix_chains(lookups, chunk_tokens=128).node_only == []
