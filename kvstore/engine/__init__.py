"""The tiered read/write engine: the node's NVMe cache in front of the object store (`TieredStore`, in
`manager`, which lists the parts)."""

from kvstore.engine.manager import ShutdownReport, TieredStore
from kvstore.engine.probes import Presence
from kvstore.engine.state import ChunkEvent
from kvstore.engine.threads import EngineThreads
from kvstore.engine.writes import StoreOutcome

__all__ = ["ChunkEvent", "EngineThreads", "Presence", "ShutdownReport", "StoreOutcome", "TieredStore"]
