"""An engine's view of its node's agent: `AgentWatch`.

From the engine's housekeeping thread, every ``every_s``: whether an agent runs and is not hung (the
engine's ``kvstore:agent_up``), said once in the log when that changes. An engine that may start one
(``start``: the vLLM tier's ``agent: auto``) replaces a dead agent, and a hung one too: it kills the hung
process (the one the kernel says holds the lock, checked again just before) and starts a new agent, at most
every ``restart_every_s`` (`RESTART_EVERY_S`). Nothing here waits on the agent.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from kvstore.node.agent_files import agent_status, signal_agent

__all__ = ["RESTART_EVERY_S", "AgentWatch", "kill_if_hung"]

log = logging.getLogger(__name__)

# An agent that crashes at start is not restarted more often; a new one has this long to take its lock.
RESTART_EVERY_S = 30.0


class AgentWatch:
    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        *,
        start: Callable[[], object] | None = None,
        every_s: float = 5.0,
        restart_every_s: float | None = None,
    ) -> None:
        self._directory = Path(cache_dir)
        self._start = start
        self._every = every_s
        self._restart_every = RESTART_EVERY_S if restart_every_s is None else restart_every_s
        self._checked_at = float("-inf")
        self._started_at = float("-inf")
        self.up: bool | None = None  # unknown until the first check

    @property
    def starting(self) -> bool:
        """This engine started an agent moments ago that may not listen yet."""
        return time.monotonic() - self._started_at < self._restart_every

    def check(self) -> bool:
        now = time.monotonic()
        if now - self._checked_at < self._every and self.up is not None:
            return self.up
        self._checked_at = now
        status = agent_status(self._directory)
        up = status.running and not status.hung
        if up != self.up:
            self._say(up, status.hung, status.describe())
            self.up = up
        if self._start is None or up:
            return up
        if status.hung:
            kill_if_hung(self._directory)
        if now - self._started_at >= self._restart_every:
            self._started_at = now
            try:
                self._start()
            except (OSError, ValueError) as exc:
                log.warning("could not start a node agent: %s", exc)
        return up

    def _say(self, up: bool, hung: bool, described: str) -> None:
        if up:
            log.info("node agent runs for %s", self._directory)
            return
        action = "; starting one" if self._start is not None else " (start `kvstore agent`)"
        if hung:
            log.warning(
                "the node agent for %s is hung (%s): uploads wait in the journal%s",
                self._directory,
                described,
                "; replacing it" if self._start is not None else " (restart `kvstore agent`)",
            )
            return
        log.warning(
            "no node agent runs for %s: uploads wait in the journal%s",
            self._directory,
            action,
        )


def kill_if_hung(cache_dir: str | os.PathLike[str]) -> bool:
    """Kill the cache's agent if it is hung (checked again, as the kernel says, just before): its LMDB write
    lock (a robust mutex) and its flock go with it, and a new agent can take over. Whether it was killed."""
    status = agent_status(cache_dir)
    if not status.hung:
        return False
    log.warning("killing the hung node agent of %s (%s)", cache_dir, status.describe())
    return signal_agent(cache_dir, status, signal.SIGKILL)
