"""How a benchmark becomes a `kvstore bench` command, the one way: its options are a frozen dataclass whose
fields are declared with `option(default=..., help=...)`, and `bench_command(name, Options)` turns a function
of one `Options` into a command whose flags are those fields, in their order (`chunks_per_job` is
`--chunks-per-job`, a `bool` is `--x/--no-x`); the function's docstring is the command's help.

    @bench_options
    class GCOptions:
        objects: int = option(default=200_000, help="Chunk objects to generate")

    @bench_command("gc", GCOptions)
    def bench_gc(o: GCOptions) -> None:
        ...  # the run, with o.objects; then its tables and its results file

Also what every command prints the same way: progress lines, tables of right-aligned figures, the results
file, and refusals of a bad option (exit 2). This module and the `*_cli` modules import only typer and rich:
a benchmark's own modules (vLLM, numpy, ...) are imported inside its command, so `kvstore --help` is fast
and works where vLLM is not installed.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Generic, NoReturn, TypeVar, dataclass_transform

import typer
from rich.table import Table

from kvstore.admin.cli_common import EXIT_CONFIG, console, say
from kvstore.connector.configs import CPU_BLOCK_TOKENS

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from kvstore.connector.harness.slow_link import LinkShape

__all__ = [
    "BUCKET_MB_S_HELP",
    "BUCKET_RTT_MS_HELP",
    "CHUNK_TOKENS_HELP",
    "TIER_OPTIONS_HELP",
    "BenchCommand",
    "bench_command",
    "bench_options",
    "chunk_tokens_or_exit",
    "link_or_exit",
    "link_said",
    "option",
    "progress",
    "refuse",
    "table",
    "tier_options_or_exit",
    "write_results",
]

T = TypeVar("T")
OptionsT = TypeVar("OptionsT", bound="DataclassInstance")

_HELP = "help"  # the metadata key of an option's help line
TIER_OPTIONS_HELP = "More options for our tier's entry, a JSON object"
CHUNK_TOKENS_HELP = (
    "Tokens per offloaded chunk for every method, a multiple of 128 (vLLM's block_size; 0: one block, "
    "vLLM's default). Each chunk is one object in the bucket."
)

BUCKET_RTT_MS_HELP = (
    "Every method's requests to the S3 server through a link with this round trip, ms (0: none), as to a "
    "bucket elsewhere"
)
BUCKET_MB_S_HELP = "... and this rate per connection, MB/s (0: no limit)"


def option(*, default: T, help: str) -> T:
    """A field of a benchmark's options: its default and its line in `--help`."""
    return dataclasses.field(default=default, metadata={_HELP: help})


@dataclass_transform(frozen_default=True, field_specifiers=(option,))
def bench_options(cls: type[T]) -> type[T]:
    """A benchmark's options: a frozen dataclass whose fields are `option`s."""
    return dataclass(frozen=True)(cls)


@dataclass(frozen=True)
class BenchCommand(Generic[OptionsT]):
    """A benchmark's command: its name, its options and what it does with them."""

    name: str
    options: type[OptionsT]
    run: Callable[[OptionsT], None]

    def register(self, app: typer.Typer) -> None:
        """Add the command to `app`, its flags read off the options' fields."""

        def command(**values: Any) -> None:
            self.run(self.options(**values))

        # typer reads a command's flags off its signature: a keyword per field, typed, with default and help.
        types = typing.get_type_hints(self.options)
        command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [
                inspect.Parameter(
                    f.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=f.default,
                    annotation=Annotated[types[f.name], typer.Option(help=f.metadata[_HELP])],
                )
                for f in dataclasses.fields(self.options)
            ]
        )
        command.__doc__ = self.run.__doc__
        app.command(self.name)(command)


def bench_command(
    name: str, options: type[OptionsT]
) -> Callable[[Callable[[OptionsT], None]], BenchCommand[OptionsT]]:
    """Declare the decorated function, given the parsed `options`, as the command `kvstore bench <name>`."""

    def declare(run: Callable[[OptionsT], None]) -> BenchCommand[OptionsT]:
        return BenchCommand(name, options, run)

    return declare


def progress(message: str) -> None:
    """A benchmark's progress line (dim, between its tables)."""
    console.print(f"[dim]... {message}[/dim]")


def table(title: str, columns: tuple[str, ...]) -> Table:
    """A table of figures: every column right-aligned."""
    out = Table(title=title)
    for column in columns:
        out.add_column(column, justify="right")
    return out


def write_results(path: Path, text: str) -> None:
    """The results file (its folder made), and the line that names it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    console.print(f"results written to {path}")


def refuse(label: str, message: object) -> NoReturn:
    """A bad option: one line naming it, exit code 2."""
    say(label, message)
    raise typer.Exit(EXIT_CONFIG)


def chunk_tokens_or_exit(tokens: int) -> int:
    """`--chunk-tokens`, checked: 0 or a positive multiple of vLLM's CPU block (128 tokens); else exit 2."""
    if tokens < 0 or tokens % CPU_BLOCK_TOKENS:
        refuse(
            "bad --chunk-tokens",
            f"{tokens}: 0 or a positive multiple of {CPU_BLOCK_TOKENS} (vLLM's CPU block)",
        )
    return tokens


def link_or_exit(rtt_ms: float, mb_s: float) -> LinkShape | None:
    """The link `--bucket-rtt-ms` and `--bucket-mb-s` ask for (None: neither); exit 2 on a bad value."""
    from kvstore.connector.harness.slow_link import LinkShape

    if not rtt_ms and not mb_s:
        return None
    if not (0 <= rtt_ms < 10_000 and 0 <= mb_s < math.inf):
        refuse("bad --bucket-rtt-ms / --bucket-mb-s", f"{rtt_ms}, {mb_s}: >= 0, finite, a round trip < 10 s")
    return LinkShape(rtt_ms / 1000, mb_s * 1e6 if mb_s else math.inf)


def link_said(link: str) -> str:
    """What a title adds for a run whose S3 server was reached through ``link`` (``StoreTarget.link``)."""
    return f", S3 through a link of {link}" if link else ""


def tier_options_or_exit(text: str) -> dict[str, object]:
    """`--tier-options` as a dict; exit 2 naming the option when it is not a JSON object."""
    try:
        options = json.loads(text)
    except ValueError as exc:
        refuse("bad --tier-options", exc)
    if not isinstance(options, dict):
        refuse("bad --tier-options", f"{text!r} (a JSON object is needed)")
    return options
