"""Store and cold load, ours against vLLM's `fs` tier, one chunk size: both tiers on the same disk, the same
chunks and job shapes, in interleaved rounds (the best round of each counts); the page cache dropped before
every load, every loaded byte compared with what was stored; and, for ours, how long the node agent took to
upload what was stored to the object store (a `file://` store, so no S3 server shares the cores)."""

from __future__ import annotations

import functools
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

from kvstore.agent.uploads import wait_uploaded
from kvstore.connector.bench.disk import evict_page_cache
from kvstore.connector.bench.tier_driver import (
    Primary,
    Timed,
    close_tier,
    fs_tier,
    keys_for,
    make_jobs,
    our_tier,
    run_jobs,
    wait_lookups,
)
from kvstore.connector.tier import KVStoreTier

__all__ = ["SizeResult", "bench_size"]


@dataclass
class SizeResult:
    chunk_bytes: int
    chunks: int
    store_gb_s: float
    fs_store_gb_s: float
    store_vs_fs: float
    upload_gb_s: float  # NVMe journal -> object store (file://) by the node agent, after the store
    cold_load_gb_s: float
    fs_cold_load_gb_s: float
    cold_load_vs_fs: float
    rounds: int
    # CPU microseconds per chunk of the calling process (vLLM's, here: the tier's threads and the scheduler
    # loop), median over rounds; the node agent is a process of its own and is not in ours.
    store_cpu_us: float = 0.0
    fs_store_cpu_us: float = 0.0
    cold_load_cpu_us: float = 0.0
    fs_cold_load_cpu_us: float = 0.0


def _store_and_load(
    make: Callable[[], SecondaryTierManager],
    primary: Primary,
    keys: Sequence[OffloadKey],
    per_job: int,
    root: Path,
    after_store: Callable[[SecondaryTierManager], None] = lambda _tier: None,
) -> tuple[Timed, Timed]:
    """(store, cold load) of one round on a fresh tier; the loaded bytes are checked."""
    n = len(keys)
    tier = make()
    try:
        store_s = run_jobs(tier, make_jobs(keys, range(n), per_job, 1), load=False)
        after_store(tier)
        wait_lookups(tier, keys)
        evict_page_cache(root)
        load_s = run_jobs(tier, make_jobs(keys, range(n, 2 * n), per_job, 100_000), load=True)
        bad = [i for i in range(n) if not primary.same(i, n + i)]
        if bad:
            raise RuntimeError(f"{type(tier).__name__}: {len(bad)} chunks loaded wrong bytes")
        primary.map[n * primary.chunk_bytes :] = bytes(n * primary.chunk_bytes)
    finally:
        close_tier(tier)
    return store_s, load_s


def _wait_uploads(seconds: list[float], tier: SecondaryTierManager) -> None:
    """After the store: how long until the upload journal is drained into the object store."""
    assert isinstance(tier, KVStoreTier)
    start = time.perf_counter()
    if not wait_uploaded(tier.engine.cache, 600):
        raise RuntimeError("uploads did not finish")
    seconds.append(time.perf_counter() - start)


def bench_size(chunk_bytes: int, chunks: int, *, rounds: int, per_job: int, workdir: Path) -> SizeResult:
    primary = Primary(chunk_bytes, 2 * chunks)
    primary.fill(chunks, seed=chunk_bytes)
    ours_store: list[Timed] = []
    ours_load: list[Timed] = []
    fs_store: list[Timed] = []
    fs_load: list[Timed] = []
    uploads: list[float] = []
    try:
        for r in range(rounds):
            for side in ("fs", "ours") if r % 2 == 0 else ("ours", "fs"):
                root = Path(tempfile.mkdtemp(prefix=f"{side}-", dir=workdir))
                keys = keys_for(f"{side}-{chunk_bytes}-{r}", chunks)
                try:
                    if side == "fs":
                        store_s, load_s = _store_and_load(
                            functools.partial(fs_tier, primary, root), primary, keys, per_job, root
                        )
                        fs_store.append(store_s)
                        fs_load.append(load_s)
                    else:
                        make = functools.partial(our_tier, primary, root, (root / "store").as_uri())
                        store_s, load_s = _store_and_load(
                            make, primary, keys, per_job, root, functools.partial(_wait_uploads, uploads)
                        )
                        ours_store.append(store_s)
                        ours_load.append(load_s)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
    finally:
        primary.close()
    total = chunk_bytes * chunks / 1e9

    def best(runs: list[Timed]) -> float:
        return min(t.seconds for t in runs)

    def cpu_us(runs: list[Timed]) -> float:
        return statistics.median(t.cpu_s for t in runs) / chunks * 1e6

    return SizeResult(
        chunk_bytes=chunk_bytes,
        chunks=chunks,
        store_gb_s=total / best(ours_store),
        fs_store_gb_s=total / best(fs_store),
        store_vs_fs=best(fs_store) / best(ours_store),
        upload_gb_s=total / max(min(uploads), 1e-9),
        cold_load_gb_s=total / best(ours_load),
        fs_cold_load_gb_s=total / best(fs_load),
        cold_load_vs_fs=best(fs_load) / best(ours_load),
        rounds=rounds,
        store_cpu_us=cpu_us(ours_store),
        fs_store_cpu_us=cpu_us(fs_store),
        cold_load_cpu_us=cpu_us(ours_load),
        fs_cold_load_cpu_us=cpu_us(fs_load),
    )
