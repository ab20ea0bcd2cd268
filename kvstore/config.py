"""Settings shared by the CLI, the admin service and the vLLM tier: one set of names everywhere.

Values come from, in order of precedence: explicit arguments, `KVSTORE_*` environment variables, a JSON or
TOML config file named by `KVSTORE_CONFIG_FILE`, then defaults. Credentials come from the standard AWS
variables and are never printed: `SecretStr` keeps them out of reprs and logs.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kvstore.chunk import Codec
from kvstore.errors import ConfigError

GiB = 1 << 30


def default_data_dir() -> Path:
    """Where the embedded S3 server and the default cache live: $XDG_DATA_HOME/kvstore."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "kvstore"


class _ConfigFileSource(PydanticBaseSettingsSource):
    """Reads the file named by KVSTORE_CONFIG_FILE (JSON or TOML); keys are the setting names."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("KVSTORE_CONFIG_FILE")
        if not path:
            return {}
        try:
            text = Path(path).read_text()
            data = tomllib.loads(text) if path.endswith(".toml") else json.loads(text)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"KVSTORE_CONFIG_FILE={path}: cannot read config file: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"KVSTORE_CONFIG_FILE={path}: expected a table of settings")
        return data


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVSTORE_", extra="forbid", populate_by_name=True)

    # Object store. Empty store_url means "the embedded local S3 server".
    store_url: str = ""
    s3_endpoint: str | None = Field(
        default=None, validation_alias=AliasChoices("s3_endpoint", "KVSTORE_S3_ENDPOINT", "AWS_ENDPOINT_URL")
    )
    access_key: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("access_key", "KVSTORE_ACCESS_KEY", "AWS_ACCESS_KEY_ID")
    )
    secret_key: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("secret_key", "KVSTORE_SECRET_KEY", "AWS_SECRET_ACCESS_KEY"),
    )
    region: str | None = Field(
        default=None,
        validation_alias=AliasChoices("region", "KVSTORE_REGION", "AWS_REGION", "AWS_DEFAULT_REGION"),
    )

    # NVMe cache.
    cache_dir: Path = Field(default_factory=lambda: default_data_dir() / "cache")
    cache_bytes: int = 50 * GiB

    # Data path.
    codec: str = "none"
    upload_queue_bytes: int = 1 * GiB
    upload_workers: int = 8
    io_workers: int = 16
    probe_hit_ttl_s: float = 600.0
    probe_miss_ttl_s: float = 2.0
    outage_cooldown_s: float = 5.0

    # Admin service.
    admin_host: str = "127.0.0.1"
    admin_port: int = 8750
    admin_token: SecretStr | None = None
    data_dir: Path = Field(default_factory=default_data_dir)

    @field_validator("cache_bytes", "upload_queue_bytes")
    @classmethod
    def _positive_bytes(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be a positive number of bytes")
        return value

    @field_validator("upload_workers", "io_workers")
    @classmethod
    def _positive_workers(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be at least 1")
        return value

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        Codec.parse(value)
        return value.lower()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _ConfigFileSource(settings_cls))

    @property
    def codec_enum(self) -> Codec:
        return Codec.parse(self.codec)


def load_settings(**overrides: Any) -> Settings:
    """Build settings, turning validation errors into one ConfigError that names each bad option."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid kvstore settings: {problems}") from None
