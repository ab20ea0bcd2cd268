"""The tiered read/write engine and its helpers."""

from kvstore.engine.probes import Presence
from kvstore.engine.tiered import ChunkEvent, ShutdownReport, StoreOutcome, TieredStore

__all__ = ["ChunkEvent", "Presence", "ShutdownReport", "StoreOutcome", "TieredStore"]
