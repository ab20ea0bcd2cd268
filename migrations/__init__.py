"""Numbered, idempotent migrations of the NVMe cache's LMDB schema and of the bucket layout.

Each step is a module `mNNNN_<what>.py` with `VERSION`, `describe` and `apply(ctx)`; `migrate` in
`kvstore.migrations.runner` applies the steps each target still needs, in order.
"""

from kvstore.migrations.runner import (
    LATEST_VERSION,
    MIGRATIONS,
    Applied,
    MigrationContext,
    MigrationError,
    Step,
    load_steps,
    migrate,
)

__all__ = [
    "LATEST_VERSION",
    "MIGRATIONS",
    "Applied",
    "MigrationContext",
    "MigrationError",
    "Step",
    "load_steps",
    "migrate",
]
