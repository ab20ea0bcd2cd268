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
    assert prefix_chains(lookups) == [["a0", "a1"], ["w1"], ["w0"], ["b0", "b2"], ["c0"], ["c1"]]
