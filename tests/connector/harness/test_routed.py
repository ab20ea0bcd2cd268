"""How the fleet's routers pick a server: Dynamo's credit per tier, and its cost of cache and load."""

from __future__ import annotations

from kvstore.connector.harness.routed import routing_costs, weighted_blocks
from kvstore.connector.harness.router import Credit


def test_credit_counts_each_tier_beyond_the_one_above_at_its_weight() -> None:
    # 8 blocks on the device, 4 more in host memory, 4 more on disk (the indexer's counts are cumulative).
    credit = Credit(gpu=8 * 16, cpu=12 * 16, disk=16 * 16)
    assert weighted_blocks(credit, 16) == 8 + 0.75 * 4 + 0.25 * 4
    assert weighted_blocks(Credit(), 16) == 0


def test_the_cheapest_server_weighs_what_it_holds_against_what_it_is_serving() -> None:
    # A 20-block prompt; server 0 holds 16 of its blocks, server 1 none.
    assert routing_costs(20, (16.0, 0.0), (0, 0)) == (4.0, 20.0)  # idle: the cache wins
    assert routing_costs(20, (16.0, 0.0), (30, 0)) == (34.0, 20.0)  # busy: the idle server wins
    assert routing_costs(20, (30.0, 0.0), (0, 0)) == (0.0, 20.0)  # credit beyond the prompt is no gain
