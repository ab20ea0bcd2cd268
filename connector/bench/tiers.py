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
    with the best S3 client here (the data path's own) and the same number of threads; with `server_core`,
    the embedded S3 server on a core of its own, both sides on the others (`kvstore.connector.bench.cores`);
    through a link to the server (`bench_target`'s), both alike.
Also the raw disk: an O_DIRECT `dd` write and read in the same run. Results are ratios within one run.

This module runs the parts in that order and gathers their report: `disk` (the raw disk), `tiers_store_load`
(store and cold load against `fs`), `tiers_object_path` (the new node against raw GETs), each driving the
tiers through `tier_driver`; `tiers_cli` is the command.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvstore.connector.bench.disk import DiskResult, dd_bandwidth
from kvstore.connector.bench.target import StoreTarget, cores_for
from kvstore.connector.bench.tiers_object_path import ObjectPathResult, bench_object_path
from kvstore.connector.bench.tiers_store_load import SizeResult, bench_size

__all__ = ["TiersReport", "bench_object_path", "bench_size", "run_tiers_bench"]


@dataclass
class TiersReport:
    sizes: list[SizeResult] = field(default_factory=list)
    object_path: list[ObjectPathResult] = field(default_factory=list)
    disk: DiskResult | None = None
    chunks_per_job: int = 0
    # The object path ran with the S3 server's threads on these cores and the benchmark's on the others.
    server_cpus: list[int] = field(default_factory=list)
    link: str = ""  # ... and through a link of this shape to the server (`StoreTarget.link`), if any
    data: str = "synthetic bf16: standard-normal values rounded to bfloat16"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def run_tiers_bench(
    *,
    sizes: Sequence[int],
    total_bytes: int,
    rounds: int,
    chunks_per_job: int,
    target: StoreTarget | None,
    object_bytes: int,
    workers: int,
    server_core: bool = False,
    workdir: Path | None = None,
    progress: Callable[[str], None] = lambda _msg: None,
) -> TiersReport:
    """`server_core`: the object path with the target's local S3 server on a core of its own
    (`CoresUnavailable` at once when that cannot be done)."""
    report = TiersReport(chunks_per_job=chunks_per_job, link=target.link if target else "")
    apart = cores_for(target, server_core)
    with _workdir(workdir) as root:
        progress("raw disk (O_DIRECT dd)")
        report.disk = dd_bandwidth(root)
        for size in sizes:
            chunks = max(8, total_bytes // size)
            progress(f"store and cold load, {size // 1024} KiB x {chunks}, ours vs vLLM fs, {rounds} rounds")
            report.sizes.append(bench_size(size, chunks, rounds=rounds, per_job=chunks_per_job, workdir=root))
        if target is not None and target.is_s3:  # a new node's path to S3, against raw GETs
            target.settle()
            with apart as (server_cpus, _):
                report.server_cpus = sorted(server_cpus)
                for size in sizes:
                    chunks = max(8, object_bytes // size)
                    progress(f"object path of a new node, {size // 1024} KiB x {chunks}")
                    report.object_path.append(
                        bench_object_path(
                            size, chunks, target=target, rounds=rounds, workers=workers, workdir=root
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
