"""Settings: one set of names from arguments, environment and a config file; bad values name the option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.config import load_settings
from kvstore.errors import ConfigError


def test_environment_and_aws_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSTORE_STORE_URL", "s3://bucket/prefix")
    monkeypatch.setenv("KVSTORE_S3_ENDPOINT", "http://127.0.0.1:9000")
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVSTORE_CACHE_BYTES", "12345")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    settings = load_settings()
    assert settings.store_url == "s3://bucket/prefix"
    assert settings.s3_endpoint == "http://127.0.0.1:9000"
    assert settings.cache_dir == tmp_path and settings.cache_bytes == 12345
    assert settings.secret_key is not None and settings.secret_key.get_secret_value() == "very-secret-value"
    assert "very-secret-value" not in repr(settings) and "very-secret-value" not in str(settings.model_dump())


def test_arguments_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_CODEC", "zstd")
    assert load_settings(codec="none").codec == "none"
    assert load_settings().codec == "zstd"


def test_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "kvstore.json"
    path.write_text(json.dumps({"cache_bytes": 999, "codec": "zstd"}))
    monkeypatch.setenv("KVSTORE_CONFIG_FILE", str(path))
    settings = load_settings()
    assert settings.cache_bytes == 999 and settings.codec == "zstd"
    toml = tmp_path / "kvstore.toml"
    toml.write_text('store_url = "file:///tmp/x"\n')
    monkeypatch.setenv("KVSTORE_CONFIG_FILE", str(toml))
    assert load_settings().store_url == "file:///tmp/x"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"cache_bytes": 0}, "cache_bytes"),
        ({"cache_bytes": -5}, "cache_bytes"),
        ({"upload_queue_bytes": 0}, "upload_queue_bytes"),
        ({"io_workers": 0}, "io_workers"),
        ({"codec": "lz5"}, "codec"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_bad_values_name_the_option(overrides: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_settings(**overrides)


def test_unreadable_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSTORE_CONFIG_FILE", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="KVSTORE_CONFIG_FILE"):
        load_settings()
