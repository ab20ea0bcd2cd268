"""A benchmark's result files, written alike: `<name>.json` beside `<name>.png`, drawn off screen."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["figure", "json_and_png", "redact_logs"]


def json_and_png(out_dir: Path, name: str, text: str, plot: Callable[[Path], None]) -> tuple[Path, Path]:
    """`<name>.json` holding `text` and `<name>.png` that `plot` draws, under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"{name}.json", out_dir / f"{name}.png"
    json_path.write_text(text)
    plot(png_path)
    return json_path, png_path


@contextlib.contextmanager
def figure(path: Path, rows: int, cols: int, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """A matplotlib figure and its axes, laid out and saved to `path` on exit (Agg: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, **subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def redact_logs(folder: Path, secrets: list[str]) -> None:
    """Replace every occurrence of `secrets` in the logs under `folder` (vLLM logs its whole
    `kv_transfer_config` at start, and vLLM's object tier takes its S3 keys there)."""
    wanted = [secret.encode() for secret in secrets if len(secret) >= 8]
    if not wanted:
        return
    for log in folder.glob("*.log"):
        try:
            data = log.read_bytes()
        except OSError:
            continue
        clean = data
        for secret in wanted:
            clean = clean.replace(secret, b"[redacted]")
        if clean != data:
            log.write_bytes(clean)
