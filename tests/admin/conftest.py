"""Fixtures of the admin tests: a stand-in vLLM endpoint serving the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.admin.vllm_standin import VLLMStandIn


@pytest.fixture
def vllm(tiny_model: Path) -> Iterator[VLLMStandIn]:
    """The tiny model served as "tiny" from the root "org/tiny" (the model name of the tests' namespaces)."""
    standin = VLLMStandIn(tiny_model, served="tiny", root="org/tiny")
    yield standin
    standin.close()
