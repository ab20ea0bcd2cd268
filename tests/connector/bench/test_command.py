"""The one way a benchmark declares its command (`bench_options`, `option`, `bench_command`): the flags typer
builds from the fields, the parsed options the run gets, and `kvstore bench` as assembled from them."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvstore.connector.bench.cli import COMMANDS, bench_app
from kvstore.connector.bench.command import (
    bench_command,
    bench_options,
    chunk_tokens_or_exit,
    option,
    tier_options_or_exit,
)


@bench_options
class ToyOptions:
    chunks_per_job: int = option(default=16, help="Chunks per job")
    output: Path = option(default=Path("out.json"), help="Results file")
    model: Path | None = option(default=None, help="Model directory")
    pin: bool = option(default=True, help="Pin the nodes")


def _toy_app(seen: list[ToyOptions]) -> typer.Typer:
    @bench_command("toy", ToyOptions)
    def toy(o: ToyOptions) -> None:
        """A toy benchmark."""
        seen.append(o)

    app = typer.Typer()
    toy.register(app)
    app.command("other")(lambda: None)  # two commands, so typer keeps `toy` as a subcommand
    return app


def test_flags_come_from_the_fields_and_the_run_gets_the_parsed_options() -> None:
    seen: list[ToyOptions] = []
    app = _toy_app(seen)
    runner = CliRunner()

    assert runner.invoke(app, ["toy"]).exit_code == 0
    assert seen[-1] == ToyOptions()
    done = runner.invoke(app, ["toy", "--chunks-per-job", "4", "--model", "m", "--no-pin", "--output", "x"])
    assert done.exit_code == 0, done.output
    assert seen[-1] == ToyOptions(chunks_per_job=4, output=Path("x"), model=Path("m"), pin=False)

    help_text = runner.invoke(app, ["toy", "--help"], env={"COLUMNS": "200"}).output
    assert "A toy benchmark." in help_text
    for line in ("--chunks-per-job", "Chunks per job [default: 16]", "--no-pin", "[default: out.json]"):
        assert line in help_text


def test_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ToyOptions().chunks_per_job = 1  # type: ignore[misc]


def test_every_bench_command_has_exactly_its_options_fields_as_flags() -> None:
    group = typer.main.get_group(bench_app)
    assert (
        list(group.commands)
        == [c.name for c in COMMANDS]
        == ["gc", "tiers", "offered", "vllm", "multiturn", "fleet"]
    )
    for declared in COMMANDS:
        command = group.commands[declared.name]
        fields = dataclasses.fields(declared.options)
        assert [p.name for p in command.params] == [f.name for f in fields], declared.name
        for param, field in zip(command.params, fields, strict=True):
            assert param.default == field.default, (declared.name, param.name)
            assert getattr(param, "help", None) == field.metadata["help"], (declared.name, param.name)
        assert command.help == inspect.getdoc(declared.run)


@pytest.mark.parametrize("text", ["[1]", "{oops", "3"])
def test_bad_tier_options_exit_2(text: str) -> None:
    with pytest.raises(typer.Exit) as raised:
        tier_options_or_exit(text)
    assert raised.value.exit_code == 2


def test_tier_options_as_a_dict() -> None:
    assert tier_options_or_exit('{"gil_switch_interval_s": 0.001}') == {"gil_switch_interval_s": 0.001}


@pytest.mark.parametrize("tokens", [-128, 100, 130])
def test_bad_chunk_tokens_exit_2(tokens: int) -> None:
    with pytest.raises(typer.Exit) as raised:
        chunk_tokens_or_exit(tokens)
    assert raised.value.exit_code == 2


@pytest.mark.parametrize("tokens", [0, 128, 256, 1024])
def test_chunk_tokens_of_whole_blocks_pass(tokens: int) -> None:
    assert chunk_tokens_or_exit(tokens) == tokens
