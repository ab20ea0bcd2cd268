"""Shared fixtures for the vLLM tests: the tiny local model, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.connector.harness.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")
