"""The disk under the tiers: its raw bandwidth (an O_DIRECT `dd` write and read, what every tier is held
against) and cold reads (files dropped from the page cache)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DiskResult", "dd_bandwidth", "evict_page_cache"]


@dataclass
class DiskResult:
    dd_write_gb_s: float
    dd_read_gb_s: float


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


def evict_page_cache(root: Path) -> None:
    """Drop every file under `root` from the page cache (cold reads, as on a node whose NVMe holds far more
    than its RAM). posix_fadvise needs no root; dirty pages are written first so they can be dropped."""
    os.sync()
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # a live server's temporary file, gone meanwhile
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
