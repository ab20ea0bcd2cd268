"""The options of a `secondary_tiers` entry for `KVStoreTier`: which it may carry, their defaults and checks.

An entry carries the settings of the data path and routing groups (never the credentials or the admin
service's: those come from the environment) and the tier's own options below. An unknown option or a value
out of range is a `ConfigError` naming it, raised while vLLM builds the tier.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import Locality

from kvstore.config import DataPathSettings, RoutingSettings, Settings, fields_of, load_settings
from kvstore.connector.tier_events import parse_locality
from kvstore.errors import ConfigError
from kvstore.runtime import AgentMode

# Python's default GIL switch interval is 5 ms; while a request waits on the tier, this (see `TierOptions`).
FAST_SWITCH_S = 0.00002
# The longest a step that scheduled nothing waits for the tier (see `TierOptions`).
IDLE_STEP_WAIT_S = 0.01
# A request's last tokens not waited for if its beginning is held: a conversation's new turn (`TierOptions`).
NO_WAIT_TAIL_TOKENS = 512

_SETTINGS_OPTIONS = fields_of(DataPathSettings, RoutingSettings)
_TIER_OPTIONS = {
    "enable_kv_events",
    "locality",
    "job_workers",
    "agent",
    "gil_switch_interval_s",
    "stats_interval_s",
    "job_batch_chunks",
    "timeline_path",
    "probe_tail_tokens",
    "no_wait_tail_tokens",
    "idle_step_wait_s",
}
# `agent`: "auto" (default) starts the node agent when none runs on this cache directory; "external" leaves it
# to the operator (`kvstore agent` in a DaemonSet container or a systemd unit).
_AGENT_CHOICES: dict[str, AgentMode] = {"auto": "spawn", "external": "none"}


@dataclass(frozen=True)
class TierOptions:
    settings: Settings
    locality: Locality  # of the chunks on this node's NVMe, in KV events
    object_locality: Locality  # of the chunks only in the bucket
    # While a request waits on the tier (a load, or a probe after a RETRY), vLLM's engine loop spins on the
    # GIL, and each of the tier's threads coming back from a read or an index lookup waits up to Python's
    # switch interval (5 ms) for it: a load of 50 chunks could spend most of its time queueing. A short
    # interval while such work is pending bounds each hand-off; the process's own interval is restored when
    # none is. Stores are write-behind and leave it alone: a short interval costs the scheduler thread
    # preemptions. The switch interval is process-wide and was measured on the CPU backend only, where the
    # forward pass competes for the same GIL: on by default with `CPUTieringSpec`, off (0) with the stock
    # GPU spec until it has been measured there; `gil_switch_interval_s` sets it either way.
    gil_switch_interval_s: float
    job_workers: int  # job threads per kind (loads, stores)
    job_batch_chunks: int
    agent: AgentMode
    timeline_path: str | None  # benchmarks: each request's milestones (see `kvstore.engine.timeline`)
    # A request's unknown tail of at most this many tokens, after a beginning vLLM or the tier holds (a
    # conversation's new turn), is asked of this node only: no bucket round trip holds the request. Off by
    # default: in a fleet the tail may be the turn another node served (`connector/probe_order.py`).
    probe_tail_tokens: int
    # The last this many tokens of a request whose beginning vLLM or the tier holds are not waited for: an
    # unknown chunk there is a miss at once, while the probe asks about it in the background (see
    # `kvstore.connector.unheld_tail`). 0: every unknown chunk waits for the probe's answer.
    no_wait_tail_tokens: int
    stats_interval_s: float
    enable_kv_events: bool
    # A step that scheduled nothing, while the tier has probes or jobs in flight, waits up to this long (less
    # when a job finishes) before vLLM steps again: nothing runs that the wait could delay, and each idle step
    # costs the engine's thread a lookup of every waiting chunk (a new node's 47-chunk request took 90 steps
    # and half the process's CPU while its GETs shared the cores; see `kvstore.connector.idle_step`). A
    # request that arrives meanwhile is scheduled up to this much later. 0: off.
    idle_step_wait_s: float


def parse_tier_options(options: Mapping[str, Any], *, cpu_spec: bool) -> TierOptions:
    """The tier's options from a `secondary_tiers` entry (``cpu_spec``: built under `CPUTieringSpec`)."""
    unknown = sorted(set(options) - _SETTINGS_OPTIONS - _TIER_OPTIONS)
    if unknown:
        raise ConfigError(
            f"KVStoreTier: unknown option(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(_SETTINGS_OPTIONS | _TIER_OPTIONS))}"
        )
    settings = load_settings(**{k: v for k, v in options.items() if k in _SETTINGS_OPTIONS})
    if not settings.store_url:
        raise ConfigError("KVStoreTier: store_url is required (or set KVSTORE_STORE_URL)")
    switch = float(options.get("gil_switch_interval_s", FAST_SWITCH_S if cpu_spec else 0.0))
    if not 0 <= switch < 1:
        raise ConfigError("KVStoreTier: gil_switch_interval_s must be >= 0 and < 1 (seconds)")
    workers = int(options.get("job_workers", 1))
    if workers < 1:
        raise ConfigError("KVStoreTier: job_workers must be >= 1")
    agent = str(options.get("agent", "auto"))
    if agent not in _AGENT_CHOICES:
        raise ConfigError(f"KVStoreTier: agent must be one of {', '.join(_AGENT_CHOICES)}, got {agent!r}")
    tail_tokens = int(options.get("probe_tail_tokens", 0))
    if tail_tokens < 0:
        raise ConfigError("KVStoreTier: probe_tail_tokens must be >= 0")
    no_wait_tail = int(options.get("no_wait_tail_tokens", NO_WAIT_TAIL_TOKENS))
    if no_wait_tail < 0:
        raise ConfigError("KVStoreTier: no_wait_tail_tokens must be >= 0")
    idle_wait = float(options.get("idle_step_wait_s", IDLE_STEP_WAIT_S))
    if not 0 <= idle_wait <= 0.1:
        raise ConfigError("KVStoreTier: idle_step_wait_s must be >= 0 and <= 0.1 (seconds)")
    timeline = options.get("timeline_path")
    return TierOptions(
        settings=settings,
        locality=parse_locality("locality", options.get("locality"), Locality.LOCAL),
        object_locality=parse_locality("object_locality", settings.object_locality, Locality.LOCAL),
        gil_switch_interval_s=switch,
        job_workers=workers,
        job_batch_chunks=int(options.get("job_batch_chunks", 256)),
        agent=_AGENT_CHOICES[agent],
        timeline_path=str(timeline) if timeline else None,
        probe_tail_tokens=tail_tokens,
        no_wait_tail_tokens=no_wait_tail,
        stats_interval_s=float(options.get("stats_interval_s", 0.5)),
        enable_kv_events=bool(options.get("enable_kv_events")),
        idle_step_wait_s=idle_wait,
    )
