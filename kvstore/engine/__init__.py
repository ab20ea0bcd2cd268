"""The tiered read/write engine and its helpers."""

from kvstore.engine.tiered import ChunkEvent, Presence, ShutdownReport, StoreOutcome, TieredStore

__all__ = ["ChunkEvent", "Presence", "ShutdownReport", "StoreOutcome", "TieredStore"]
