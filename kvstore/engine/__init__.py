"""The tiered read/write engine as vLLM's process runs it: the node's NVMe cache in front of the object store
(`TieredStore`, in `manager`, which lists the parts). The background work is the node agent's
(`kvstore.agent`)."""

from kvstore.engine.answers import Presence
from kvstore.engine.manager import ShutdownReport, TieredStore
from kvstore.engine.outcomes import ChunkEvent
from kvstore.engine.threads import EngineThreads
from kvstore.engine.writes import StoreOutcome

__all__ = ["ChunkEvent", "EngineThreads", "Presence", "ShutdownReport", "StoreOutcome", "TieredStore"]
