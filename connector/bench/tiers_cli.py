"""`kvstore bench tiers`: its options, the run (`tiers`) and the codecs (`codecs`), their tables and JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.admin.cli_common import console, settings_or_exit
from kvstore.connector.bench.command import (
    BUCKET_MB_S_HELP,
    BUCKET_RTT_MS_HELP,
    bench_command,
    bench_options,
    link_or_exit,
    option,
    progress,
    refuse,
    table,
    write_results,
)

if TYPE_CHECKING:
    from kvstore.connector.bench.codecs import CodecResult
    from kvstore.connector.bench.tiers import TiersReport

__all__ = ["TiersOptions", "bench_tiers"]


@bench_options
class TiersOptions:
    sizes: str = option(default="256,2048", help="Chunk sizes in KiB, comma separated")
    total_mib: int = option(default=256, help="Data stored and loaded per chunk size, MiB")
    object_mib: int = option(default=256, help="Data a new node loads from the S3 store, MiB")
    rounds: int = option(default=2, help="Interleaved rounds (the best of each side counts)")
    chunks_per_job: int = option(default=16, help="Chunks per vLLM store/load job")
    workers: int = option(default=16, help="Threads of the raw GET baseline (our io_workers)")
    server_core: bool = option(
        default=False,
        help="The object path with the embedded S3 server on a core of its own, as a remote bucket's is",
    )
    bucket_rtt_ms: float = option(default=0.0, help=BUCKET_RTT_MS_HELP)
    bucket_mb_s: float = option(default=0.0, help=BUCKET_MB_S_HELP)
    output: Path = option(default=Path("bench-results/tiers.json"), help="JSON results file")


@bench_command("tiers", TiersOptions)
def bench_tiers(o: TiersOptions) -> None:
    """Our tier against vLLM's fs tier through vLLM's tier API: store and cold load (page cache dropped),
    the object path of a new node against raw GETs, the raw disk, and the codecs."""
    from kvstore.connector.bench.codecs import bench_codecs
    from kvstore.connector.bench.cores import CoresUnavailable
    from kvstore.connector.bench.target import bench_target, environment
    from kvstore.connector.bench.tiers import run_tiers_bench

    link = link_or_exit(o.bucket_rtt_ms, o.bucket_mb_s)
    with bench_target(settings_or_exit(), "tiers", link) as target, environment(target.env):
        try:
            report = run_tiers_bench(
                sizes=[int(s) * 1024 for s in o.sizes.split(",")],
                total_bytes=o.total_mib << 20,
                rounds=o.rounds,
                chunks_per_job=o.chunks_per_job,
                target=target,
                object_bytes=o.object_mib << 20,
                workers=o.workers,
                server_core=o.server_core,
                progress=progress,
            )
        except CoresUnavailable as exc:
            refuse("bad --server-core", exc)
    codecs = bench_codecs()
    _print(report, codecs, o.rounds)
    result = json.loads(report.to_json())
    result["codecs"] = [vars(c) for c in codecs]
    write_results(o.output, json.dumps(result, indent=2))


def _print(report: TiersReport, codecs: list[CodecResult], rounds: int) -> None:
    disk = report.disk
    if disk is not None:
        console.print(
            f"raw disk (O_DIRECT dd, 2 MiB blocks): write {disk.dd_write_gb_s:.2f} GB/s, "
            f"read {disk.dd_read_gb_s:.2f} GB/s"
        )
    sizes = table(
        f"store and cold load: ours vs vLLM fs, {report.chunks_per_job} chunks per job, "
        f"best of {rounds} interleaved rounds (GB/s)",
        ("chunk", "n", "store", "fs store", "store/fs", "cold load", "fs cold load", "load/fs", "upload"),
    )
    for r in report.sizes:
        sizes.add_row(
            f"{r.chunk_bytes // 1024} KiB",
            str(r.chunks),
            f"{r.store_gb_s:.2f}",
            f"{r.fs_store_gb_s:.2f}",
            f"{r.store_vs_fs:.2f}x",
            f"{r.cold_load_gb_s:.2f}",
            f"{r.fs_cold_load_gb_s:.2f}",
            f"{r.cold_load_vs_fs:.2f}x",
            f"{r.upload_gb_s:.2f}",
        )
    console.print(sizes)
    cpu = table(
        "CPU of the calling process (vLLM's) per chunk, microseconds, median of rounds",
        ("chunk", "store", "fs store", "cold load", "fs cold load"),
    )
    for r in report.sizes:
        cpu.add_row(
            f"{r.chunk_bytes // 1024} KiB",
            f"{r.store_cpu_us:.0f}",
            f"{r.fs_store_cpu_us:.0f}",
            f"{r.cold_load_cpu_us:.0f}",
            f"{r.fs_cold_load_cpu_us:.0f}",
        )
    console.print(cpu)
    if report.object_path:
        cpus = ",".join(map(str, report.server_cpus))
        apart = f", the S3 server alone on CPU {cpus}" if cpus else ""
        apart += f", through a link of {report.link}" if report.link else ""
        objects = table(
            f"object path of a new node: first lookup to last byte loaded (GB/s){apart}",
            ("chunk", "n", "ours, end to end", "raw parallel GET", "ours/raw", "CPU us/chunk", "raw",
             "S3 GET/chunk", "raw", "$ per 1M chunks"),
        )  # fmt: skip
        for p in report.object_path:
            objects.add_row(
                f"{p.chunk_bytes // 1024} KiB",
                str(p.chunks),
                f"{p.end_to_end_gb_s:.2f}",
                f"{p.raw_get_gb_s:.2f}",
                f"{p.vs_raw:.2f}x",
                f"{p.cpu_us:.0f}",
                f"{p.raw_cpu_us:.0f}",
                "-" if p.gets_per_chunk is None else f"{p.gets_per_chunk:.2f}",
                "-" if p.raw_gets_per_chunk is None else f"{p.raw_gets_per_chunk:.2f}",
                "-" if p.usd_per_million_chunks is None else f"{p.usd_per_million_chunks:.2f}",
            )
        console.print(objects)
        threads = table(
            "where the object path's CPU goes: us per chunk by thread (MainThread: the scheduler, which looks"
            " up every waiting chunk every step; kvstore-io: GETs and checks; tokio-rt-worker: obstore's"
            " HEADs and PUTs)",
            ("chunk", "side", "by thread"),
        )
        for p in report.object_path:
            for side, spent in (("ours", p.cpu_us_by_thread), ("raw", p.raw_cpu_us_by_thread)):
                shown = ", ".join(f"{role} {us:.0f}" for role, us in spent.items() if us >= 1)
                threads.add_row(f"{p.chunk_bytes // 1024} KiB", side, shown or "-")
        console.print(threads)
    codec_table = table(
        "codecs on 2 MiB bf16-like chunks", ("codec", "ratio", "encode GB/s", "decode+verify GB/s")
    )
    for c in codecs:
        codec_table.add_row(c.codec, f"{c.ratio:.3f}", f"{c.encode_gb_s:.2f}", f"{c.decode_gb_s:.2f}")
    console.print(codec_table)
