"""The install ships the whole namespace: pyproject.toml lists every package folder by hand (setuptools cannot
discover folders mapped to other names), and a folder missing there is missing from wheels and from the
editable layout (kvstore.agent once was)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.slow


def test_every_package_folder_is_listed_under_its_import_name() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join([name, *init.parent.relative_to(ROOT / folder).parts])
        for name, folder in setuptools["package-dir"].items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found == set(setuptools["packages"])
    assert (ROOT / "kvstore" / "py.typed").is_file()  # package-data: type checkers read the annotations
