"""`kvstore bench tiers`: our tier against vLLM's own `fs` tier, both driven through vLLM's tier API.

Same disk, same chunks, same job shapes, interleaved rounds (the best round of each counts):
  - store: jobs of `chunks_per_job` chunks submitted at once, timed until every job has reported (for our
    tier that means on NVMe and in the upload journal; the upload to the object store, a `file://` store
    here so no S3 server shares the cores, is timed on its own);
  - cold load: every file of both tiers is evicted from the page cache (`posix_fadvise(DONTNEED)`) first,
    because a real node's NVMe holds far more than its RAM; then load jobs into other primary rows, timed
    until every job has reported; every byte is compared with what was stored (and our tier verifies its
    checksum on every load);
  - the object path of a new node: chunks in the S3 store, an empty NVMe cache, timed from the first lookup
    to the last byte loaded, the tier driven the way vLLM's scheduler drives it (lookups every step until
    answered, one load job per step for what was answered); against raw parallel GETs of the same objects
    with obstore and the same number of threads.
Also the raw disk: an O_DIRECT `dd` write and read in the same run. Results are ratios within one run.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

from kvstore.agent.supervisor import stop_agent
from kvstore.agent.uploads import wait_uploaded
from kvstore.connector.bench.target import StoreTarget
from kvstore.connector.harness.standalone import standalone_spec
from kvstore.connector.tier import KVStoreTier

MiB = 1 << 20
_STEP_S = 0.0005  # the pause between scheduler steps while a tier works (vLLM's engine loop)


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


@dataclass
class ObjectPathResult:
    chunk_bytes: int
    chunks: int
    end_to_end_gb_s: float  # first lookup to last byte loaded, fresh node
    raw_get_gb_s: float  # raw parallel obstore GETs of the same objects
    vs_raw: float
    cpu_us: float = 0.0  # CPU microseconds per chunk of the calling process (median over rounds)
    raw_cpu_us: float = 0.0  # ... of the raw GET loop


@dataclass
class DiskResult:
    dd_write_gb_s: float
    dd_read_gb_s: float


@dataclass
class TiersReport:
    sizes: list[SizeResult] = field(default_factory=list)
    object_path: list[ObjectPathResult] = field(default_factory=list)
    disk: DiskResult | None = None
    chunks_per_job: int = 0
    data: str = "synthetic bf16: standard-normal values rounded to bfloat16"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


# -- the primary region and the tiers under test -----------------------------------------------------------


class Primary:
    """A page-aligned primary region of `rows` chunk rows, like vLLM's shared offload region."""

    def __init__(self, chunk_bytes: int, rows: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.map = mmap.mmap(-1, chunk_bytes * rows)
        self.base = memoryview(self.map)
        self.view = self.base.cast("b", (rows, chunk_bytes))

    def fill(self, rows: int, seed: int) -> None:
        """Rows 0..rows-1: bf16-like values, different in every row."""
        rng = np.random.default_rng(seed)
        target = np.frombuffer(self.map, dtype=np.uint16)
        per_row = self.chunk_bytes // 2
        block = (rng.standard_normal(per_row * 8).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        for row in range(rows):
            start = row * per_row
            target[start : start + per_row] = np.roll(block, row * 7919)[:per_row] ^ np.uint16(row)

    def same(self, a: int, b: int) -> bool:
        size = self.chunk_bytes
        return self.map[a * size : (a + 1) * size] == self.map[b * size : (b + 1) * size]

    def close(self) -> None:
        self.view.release()
        self.base.release()
        self.map.close()


def keys_for(tag: str, n: int) -> list[OffloadKey]:
    return [make_offload_key(hashlib.sha256(f"{tag}-{i}".encode()).digest(), 0) for i in range(n)]


def our_tier(primary: Primary, root: Path, store_url: str, **options: Any) -> KVStoreTier:
    settings: dict[str, Any] = {
        "store_url": store_url,
        "cache_dir": str(root / "nvme"),
        "cache_bytes": 1 << 40,
        "pin_sync_s": 0,
    }
    return KVStoreTier(
        offloading_spec=standalone_spec(),
        primary_kv_view=primary.view,
        tier_type="KVStoreTier",
        **{**settings, **options},
    )


def fs_tier(primary: Primary, root: Path) -> FileSystemTierManager:
    return FileSystemTierManager(standalone_spec(), primary.view, "fs", root_dir=str(root / "fs"))


def close_tier(tier: SecondaryTierManager) -> None:
    tier.drain_jobs()
    tier.shutdown()
    if isinstance(tier, KVStoreTier):  # the node agent it started goes too (its directory is removed next)
        stop_agent(tier.engine.cache.directory)


# -- driving a tier the way vLLM's scheduler does ---------------------------------------------------------


@dataclass(frozen=True)
class Timed:
    seconds: float  # wall time
    cpu_s: float  # CPU time of this process (every thread), over the same span


def run_jobs(tier: SecondaryTierManager, jobs: Sequence[TransferJob], *, load: bool) -> Timed:
    """Submit every job, then poll once per step until all have reported: wall seconds from the first submit
    to the last report, and this process's CPU seconds over that span."""
    cpu = time.process_time()
    start = time.perf_counter()
    for job in jobs:
        (tier.submit_load if load else tier.submit_store)(job)
    waiting = {job.job_id for job in jobs}
    failed: list[int] = []
    while waiting:
        tier.on_schedule_end(None)  # type: ignore[arg-type]  # the standalone scheduler has no context
        for result in tier.get_finished_jobs():
            waiting.discard(result.job_id)
            if not result.success:
                failed.append(result.job_id)
        if waiting:
            time.sleep(_STEP_S)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    if failed:
        raise RuntimeError(f"{type(tier).__name__}: {len(failed)} of {len(jobs)} jobs failed")
    return Timed(elapsed, cpu)


def make_jobs(
    keys: Sequence[OffloadKey], rows: Sequence[int], per_job: int, first_id: int
) -> list[TransferJob]:
    req = ReqContext(req_id="bench")
    return [
        TransferJob(
            first_id + n,
            list(keys[i : i + per_job]),
            np.asarray(rows[i : i + per_job], dtype=np.int64),
            False,
            req,
        )
        for n, i in enumerate(range(0, len(keys), per_job))
    ]


def wait_lookups(tier: SecondaryTierManager, keys: Sequence[OffloadKey], timeout: float = 120.0) -> None:
    """Look every key up, step by step, until all are HITs (what vLLM does before it submits loads)."""
    req = ReqContext(req_id="bench-lookup")
    tier.on_new_request(req)
    pending = list(keys)
    deadline = time.monotonic() + timeout
    while pending:
        results = [tier.lookup(key, req) for key in pending]
        if LookupResult.MISS in results:
            raise RuntimeError(f"{type(tier).__name__}: a stored chunk is a miss")
        pending = [k for k, r in zip(pending, results, strict=True) if r is not LookupResult.HIT]
        tier.on_schedule_end(None)  # type: ignore[arg-type]
        if pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{type(tier).__name__}: lookups did not settle")
            time.sleep(_STEP_S)


def evict_page_cache(root: Path) -> None:
    """Drop every file under `root` from the page cache (cold reads, as on a node whose NVMe holds far more
    than its RAM). posix_fadvise needs no root; dirty pages are written first so they can be dropped."""
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


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


# -- the object path of a new node -------------------------------------------------------------------------


def _scheduler_loads(tier: SecondaryTierManager, keys: Sequence[OffloadKey], first_row: int) -> Timed:
    """From the first lookup to the last load reported, as vLLM's scheduler drives a tier: every step it
    looks up what is not loaded yet, submits one load job for what became a HIT, and polls."""
    req = ReqContext(req_id="bench-object")
    tier.on_new_request(req)
    for position, key in enumerate(keys):
        req.set_offload_key_position(key, (position + 1) * 128)
    todo = list(range(len(keys)))
    in_flight: set[int] = set()
    job_id = 200_000
    cpu = time.process_time()
    start = time.perf_counter()
    while todo or in_flight:
        for result in tier.get_finished_jobs():
            in_flight.discard(result.job_id)
            if not result.success:
                raise RuntimeError("an object-store load failed")
        hits: list[int] = []
        waiting: list[int] = []
        for i in todo:
            found = tier.lookup(keys[i], req)
            if found is LookupResult.MISS:
                raise RuntimeError("a chunk in the store is a miss")
            (hits if found is LookupResult.HIT else waiting).append(i)
        if hits:
            job_id += 1
            tier.submit_load(
                TransferJob(
                    job_id, [keys[i] for i in hits], np.asarray([first_row + i for i in hits]), True, req
                )
            )
            in_flight.add(job_id)
        todo = waiting
        tier.on_schedule_end(None)  # type: ignore[arg-type]  # the standalone scheduler has no context
        time.sleep(_STEP_S)
    return Timed(time.perf_counter() - start, time.process_time() - cpu)


def bench_object_path(
    chunk_bytes: int,
    chunks: int,
    *,
    target: StoreTarget,
    rounds: int,
    workers: int,
    workdir: Path,
) -> ObjectPathResult:
    """A new node's loads from the S3 store of `target`, against raw parallel GETs of the same objects."""
    import obstore
    from obstore.store import S3Store as RawS3

    primary = Primary(chunk_bytes, 2 * chunks)
    primary.fill(chunks, seed=chunk_bytes + 1)
    keys = keys_for(f"object-{chunk_bytes}-{time.time_ns()}", chunks)
    seeder_root = Path(tempfile.mkdtemp(prefix="seed-", dir=workdir))
    seeder = our_tier(primary, seeder_root, target.store_url, s3_endpoint=target.endpoint or "")
    try:
        run_jobs(seeder, make_jobs(keys, range(chunks), 16, 1), load=False)
        if not wait_uploaded(seeder.engine.cache, 600):
            raise RuntimeError("seeding the object store did not finish")
        names = [seeder.namespace.chunk_key(k) for k in keys]
    finally:
        close_tier(seeder)
        shutil.rmtree(seeder_root, ignore_errors=True)
    bucket, prefix = target.bucket_and_prefix
    prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    raw = RawS3(
        bucket,
        config={
            "endpoint": target.endpoint or "",
            "access_key_id": target.access_key,
            "secret_access_key": target.secret_key,
            "region": "us-east-1",
        },
        client_options={"allow_http": True},
    )

    def raw_get() -> Timed:
        cpu = time.process_time()
        start = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            sizes = list(pool.map(lambda name: len(obstore.get(raw, prefix + name).bytes()), names))
        assert all(sizes)
        return Timed(time.perf_counter() - start, time.process_time() - cpu)

    ours: list[Timed] = []
    baseline: list[Timed] = []
    try:
        for _ in range(rounds):
            baseline.append(raw_get())
            root = Path(tempfile.mkdtemp(prefix="fresh-node-", dir=workdir))
            tier = our_tier(primary, root, target.store_url, s3_endpoint=target.endpoint or "")
            try:
                ours.append(_scheduler_loads(tier, keys, chunks))
                bad = [i for i in range(chunks) if not primary.same(i, chunks + i)]
                if bad:
                    raise RuntimeError(f"{len(bad)} chunks loaded wrong bytes from the object store")
            finally:
                close_tier(tier)
                shutil.rmtree(root, ignore_errors=True)
            primary.map[chunks * chunk_bytes :] = bytes(chunks * chunk_bytes)
    finally:
        primary.close()
    total = chunk_bytes * chunks / 1e9
    best_ours, best_raw = min(t.seconds for t in ours), min(t.seconds for t in baseline)
    return ObjectPathResult(
        chunk_bytes=chunk_bytes,
        chunks=chunks,
        end_to_end_gb_s=total / best_ours,
        raw_get_gb_s=total / best_raw,
        vs_raw=best_raw / best_ours,
        cpu_us=statistics.median(t.cpu_s for t in ours) / chunks * 1e6,
        raw_cpu_us=statistics.median(t.cpu_s for t in baseline) / chunks * 1e6,
    )


# -- the raw disk -----------------------------------------------------------------------------------------


def dd_bandwidth(workdir: Path, mib: int = 1024) -> DiskResult:
    """An O_DIRECT dd write and read of `mib` MiB in 2 MiB blocks (GB/s)."""
    target = workdir / "dd.bin"
    try:
        wrote = _dd(
            ["if=/dev/zero", f"of={target}", "bs=2M", f"count={mib // 2}", "oflag=direct", "conv=fsync"]
        )
        read = _dd([f"if={target}", "of=/dev/null", "bs=2M", "iflag=direct"])
    finally:
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
    return DiskResult(dd_write_gb_s=wrote, dd_read_gb_s=read)


def _dd(args: list[str]) -> float:
    done = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    found = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", done.stderr)
    if found is None:
        raise RuntimeError(f"cannot read dd's answer: {done.stderr.strip()}")
    return int(found.group(1)) / float(found.group(2)) / 1e9


def run_tiers_bench(
    *,
    sizes: Sequence[int],
    total_bytes: int,
    rounds: int,
    chunks_per_job: int,
    target: StoreTarget | None,
    object_bytes: int,
    workers: int,
    workdir: Path | None = None,
    progress: Callable[[str], None] = lambda _msg: None,
) -> TiersReport:
    report = TiersReport(chunks_per_job=chunks_per_job)
    with _workdir(workdir) as root:
        progress("raw disk (O_DIRECT dd)")
        report.disk = dd_bandwidth(root)
        for size in sizes:
            chunks = max(8, total_bytes // size)
            progress(f"store and cold load, {size // 1024} KiB x {chunks}, ours vs vLLM fs, {rounds} rounds")
            report.sizes.append(bench_size(size, chunks, rounds=rounds, per_job=chunks_per_job, workdir=root))
        if target is not None and target.is_s3:  # a new node's path to S3, against raw GETs
            for size in sizes:
                chunks = max(8, object_bytes // size)
                progress(f"object path of a new node, {size // 1024} KiB x {chunks}")
                report.object_path.append(
                    bench_object_path(
                        size,
                        chunks,
                        target=target,
                        rounds=rounds,
                        workers=workers,
                        workdir=root,
                    )
                )
    return report


@contextlib.contextmanager
def _workdir(base: Path | None) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-tiers-", dir=base))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
