"""Settings shared by the CLI, the admin service and the vLLM tier: one set of names everywhere.

Values come from, in order of precedence: explicit arguments, `KVSTORE_*` environment variables, a JSON or
TOML config file named by `KVSTORE_CONFIG_FILE`, then defaults. Credentials come from the standard AWS
variables and are never printed: `SecretStr` keeps them out of reprs and logs.

The settings come in groups, each a model with its fields and their validators: `DataPathSettings` (stores,
NVMe cache, threads, deadlines, codec, prefetch, regions, pin sync), `StoreCredentials`, `RoutingSettings`
(what KV events tell routers), `AdminSettings` (the admin service, its vLLM endpoints, GC's events) and
`LocalSettings` (the embedded server's data). `Settings` inherits them all, so names stay flat
(`KVSTORE_<NAME>`, `<name>` in a config file) while a consumer names the group it needs, and a list of allowed
names follows from the groups (`fields_of`: a vLLM tier entry takes `DataPathSettings` and `RoutingSettings`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from kvstore.cache.index_flush import DEFAULT_FLUSH_S
from kvstore.chunk import Codec
from kvstore.errors import ConfigError

__all__ = [
    "GROUPS",
    "LOCAL_REGION",
    "AdminSettings",
    "DataPathSettings",
    "GiB",
    "LocalSettings",
    "MiB",
    "RoutingSettings",
    "Settings",
    "StoreCredentials",
    "StoreSpec",
    "default_data_dir",
    "fields_of",
    "load_settings",
    "unknown_environment",
]

log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
LOCAL_REGION = "local"
# Every float setting is a number of seconds: finite, >= 0 and at most this (far below what a thread wait
# accepts, `threading.TIMEOUT_MAX`), so no value can stop a loop for good or overflow a wait.
MAX_SECONDS = 10_000_000.0
# Environment variables with the KVSTORE_ prefix that are not settings.
_OTHER_ENV = frozenset({"KVSTORE_CONFIG_FILE"})
_OTHER_ENV_PREFIXES = ("KVSTORE_TEST_", "KVSTORE_FUZZ_")  # the test suite's own knobs
# Region names become metric label values and log words: keep them short and plain.
_REGION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


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


class StoreSpec(BaseModel):
    """One region's object store, an element of a `store_url` list. Fields left out fall back to the
    top-level settings (`s3_endpoint`, `access_key`, `secret_key`, `region`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    name: str | None = None
    endpoint: str | None = None
    access_key: SecretStr | None = None
    secret_key: SecretStr | None = None
    region: str | None = None

    @field_validator("url")
    @classmethod
    def _non_empty_url(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a non-empty store URL")
        return value.strip()

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str | None) -> str | None:
        if value is not None and not _REGION_NAME.match(value):
            raise ValueError("must be 1-63 letters, digits, '_', '.' or '-', starting with a letter or digit")
        return value

    @model_validator(mode="after")
    def _key_pair(self) -> StoreSpec:
        if (self.access_key is None) != (self.secret_key is None):
            raise ValueError("access_key and secret_key go together")
        return self


def _store_specs(items: Sequence[Any]) -> list[StoreSpec]:
    """Parse a `store_url` list: URL strings or tables; names default to local, remote-1, remote-2, ..."""
    specs: list[StoreSpec] = []
    for i, item in enumerate(items):
        if isinstance(item, StoreSpec):
            spec = item
        elif isinstance(item, str):
            spec = _one_spec(i, {"url": item})
        elif isinstance(item, dict):
            spec = _one_spec(i, item)
        else:
            raise ValueError(
                f"element {i}: expected a URL string or a table with 'url', got {type(item).__name__}"
            )
        if spec.name is None:
            spec = spec.model_copy(update={"name": LOCAL_REGION if i == 0 else f"remote-{i}"})
        specs.append(spec)
    names = [spec.name for spec in specs]
    duplicates = sorted({n for n in names if n is not None and names.count(n) > 1})
    if duplicates:
        raise ValueError(f"region names must be unique, {', '.join(duplicates)} repeats; set 'name' on each")
    return specs


def _one_spec(index: int, table: dict[str, Any]) -> StoreSpec:
    try:
        return StoreSpec.model_validate(table)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'store'}: {err['msg']}" for err in exc.errors()
        )
        raise ValueError(f"element {index}: {problems}") from None


class _Group(BaseModel):
    """What every settings group shares: names as they are (no aliases needed), nothing unknown, and the
    rule for float settings (all of them are seconds)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @field_validator("*")
    @classmethod
    def _finite_seconds(cls, value: Any) -> Any:
        # NaN passes every `< 0` check and inf stops a wait forever: refuse both for every float setting.
        if isinstance(value, float) and not (math.isfinite(value) and 0 <= value <= MAX_SECONDS):
            raise ValueError(
                f"must be a finite number of seconds between 0 and {MAX_SECONDS:.0f}, got {value}"
            )
        return value


class DataPathSettings(_Group):
    """The data path: the object stores (one per region), the NVMe cache, threads, deadlines, the codec,
    prefetching and pin sync. What a vLLM tier may set in its `secondary_tiers` entry, with `RoutingSettings`
    (credentials are `StoreCredentials`, never a tier option)."""

    # Object store. Empty store_url means "the embedded local S3 server". A list names one store per region:
    # the first is this region (read-write), the rest are read-only fallbacks (see `Settings.stores`).
    store_url: str | list[StoreSpec] = ""
    s3_endpoint: str | None = Field(
        default=None, validation_alias=AliasChoices("s3_endpoint", "KVSTORE_S3_ENDPOINT", "AWS_ENDPOINT_URL")
    )
    region: str | None = Field(
        default=None,
        validation_alias=AliasChoices("region", "KVSTORE_REGION", "AWS_REGION", "AWS_DEFAULT_REGION"),
    )

    # NVMe cache.
    cache_dir: Path = Field(default_factory=lambda: default_data_dir() / "cache")
    cache_bytes: int = 50 * GiB

    codec: Codec = Codec.NONE  # "none" or "zstd" in the environment and files
    upload_workers: int = 8
    # While the engines leave no CPU core idle, a stored chunk's upload waits up to this long (a burst's
    # uploads then cost it nothing; see `kvstore.agent.cpu_room`); the bucket has it that much later. 0: off.
    # None: on (`kvstore.agent.uploads.OWN_SERVER_HOLD_S`) with the node's own embedded server, whose bucket
    # no other node reads; off with a store other nodes share, where a chunk late is a chunk recomputed.
    upload_hold_s: float | None = None
    io_workers: int = 16
    # Threads that read and write NVMe chunk files (O_DIRECT); device queue depth comes from these.
    disk_workers: int = 8
    # O_DIRECT for chunk files: the page cache never holds a second copy of NVMe-resident chunks. Falls back
    # to buffered I/O where the filesystem refuses it (ramfs, older tmpfs); false forces buffered I/O.
    direct_io: bool = True
    # With direct_io: O_DIRECT for chunk writes too. False: stores go through the page cache (the kernel
    # writes them back; the page cache holds them until then) and loads stay O_DIRECT.
    direct_writes: bool = True
    # How often the index's commits are made durable together: a store then never waits for the disk to
    # flush every chunk written before it (`kvstore.cache.index_flush`). 0: LMDB syncs each commit.
    index_flush_s: float = DEFAULT_FLUSH_S
    # How long a load waits for the object store before its missing chunks count as misses.
    load_timeout_s: float = 5.0
    probe_hit_ttl_s: float = 600.0
    probe_miss_ttl_s: float = 2.0
    outage_cooldown_s: float = 5.0
    # Memory for chunks the vLLM scheduler's probe GETs ahead of the load that follows; 0: probe by HEAD.
    prefetch_bytes: int = 256 * MiB
    # How often a node re-reads the bucket's pin manifests into its cache (the tier and the admin service
    # do); 0 turns the periodic sync off.
    pin_sync_s: float = 60.0

    # Remote regions: a deadline per read, a cooldown after a failure, their own threads, a copy budget.
    remote_timeout_s: float = 1.5
    remote_cooldown_s: float = 30.0
    remote_workers: int = 4
    remote_copy_queue_bytes: int = 256 * MiB

    @field_validator("store_url", mode="before")
    @classmethod
    def _store_list(cls, value: Any) -> Any:
        # A JSON list arrives as text from the vLLM tier's options or an env var pydantic did not decode.
        if isinstance(value, str):
            if not value.lstrip().startswith("["):
                return value
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"looks like a JSON list of stores but does not parse: {exc}") from None
        if isinstance(value, list | tuple):
            if not value:
                raise ValueError(
                    "an empty list names no store (leave store_url unset for the embedded server)"
                )
            return _store_specs(value)
        raise ValueError("expected a store URL or a list of stores (URL strings or tables with 'url')")

    # Validator names are unique across the groups: `Settings` inherits them all, and a name repeated in two
    # groups would keep only one of the two.
    @field_validator("cache_dir", mode="before")
    @classmethod
    def _cache_dir_not_empty(cls, value: Any) -> Any:
        return _not_empty_path(value)

    @field_validator("pin_sync_s", "prefetch_bytes", "index_flush_s")
    @classmethod
    def _not_negative(cls, value: float) -> float:
        if value < 0:
            raise ValueError("must be >= 0 (0 turns it off)")
        return value

    @field_validator("remote_timeout_s", "remote_cooldown_s", "load_timeout_s")
    @classmethod
    def _positive_seconds(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be a positive number of seconds")
        return value

    @field_validator("cache_bytes", "remote_copy_queue_bytes")
    @classmethod
    def _positive_bytes(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be a positive number of bytes")
        return value

    @field_validator("upload_workers", "io_workers", "disk_workers", "remote_workers")
    @classmethod
    def _positive_workers(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be at least 1")
        return value

    @field_validator("codec", mode="before")
    @classmethod
    def _codec_by_name(cls, value: object) -> object:
        return Codec.parse(value) if isinstance(value, str) else value


class StoreCredentials(_Group):
    """The S3 credentials of the stores that name none of their own: from the standard AWS variables (or
    `KVSTORE_ACCESS_KEY` / `KVSTORE_SECRET_KEY`), never a tier option, never printed (`SecretStr`)."""

    access_key: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("access_key", "KVSTORE_ACCESS_KEY", "AWS_ACCESS_KEY_ID")
    )
    secret_key: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("secret_key", "KVSTORE_SECRET_KEY", "AWS_SECRET_ACCESS_KEY"),
    )


class RoutingSettings(_Group):
    """What routers are told: the locality of a chunk's bucket copy in KV events (the tier's and GC's)."""

    # The locality GC's BlockRemoved events give a chunk: LOCAL, like the residency the tier reports (its NVMe
    # copy or the bucket's, docs/routers.md); routers such as Dynamo's KV indexer drop REMOTE events.
    object_locality: str = "LOCAL"

    @field_validator("object_locality")
    @classmethod
    def _locality(cls, value: str) -> str:
        if value not in ("LOCAL", "REMOTE"):
            raise ValueError(f"must be 'LOCAL' or 'REMOTE' (vLLM's Locality), got {value!r}")
        return value


class AdminSettings(_Group):
    """The admin service: where it listens, its token and request limits, the vLLM endpoints it may call and
    where GC publishes its events."""

    admin_host: str = "127.0.0.1"
    admin_port: int = 8750
    admin_token: SecretStr | None = None
    # Request limits of the admin API: a bigger body answers 413; a pin or warm request with more tokens, or
    # whose tokens make more chunk keys (blocks to hash), answers 422. Memory and time per request follow.
    admin_max_body_bytes: int = 4 * MiB
    admin_max_tokens: int = 262_144
    admin_max_chunks: int = 65_536
    # GC publishes BlockRemoved here in vLLM's KV-event format (e.g. tcp://127.0.0.1:5557); empty = off.
    events_endpoint: str = ""
    # The vLLM OpenAI endpoints the admin service may call (tokenize, prefill); requests name a served model,
    # never a URL. One URL or a JSON list in KVSTORE_VLLM_URLS (decoded by `_url_list`, not by pydantic).
    vllm_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)

    @field_validator("vllm_urls", mode="before")
    @classmethod
    def _url_list(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        # From the environment or a tool's option: a JSON list, one URL, or nothing.
        if not value.lstrip().startswith("["):
            return [value] if value.strip() else []
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ValueError(f"looks like a JSON list of URLs but does not parse: {exc}") from None

    @field_validator("vllm_urls")
    @classmethod
    def _http_urls(cls, value: list[str]) -> list[str]:
        out = []
        for url in value:
            url = url.strip().rstrip("/")
            scheme, sep, rest = url.partition("://")
            if scheme not in ("http", "https") or not sep or not rest.split("/", 1)[0]:
                raise ValueError(f"each URL must be http(s)://host[:port][/path], got {url!r}")
            out.append(url)
        return out

    @field_validator("admin_port")
    @classmethod
    def _tcp_port(cls, value: int) -> int:
        if not 1 <= value <= 65535:
            raise ValueError(f"must be a TCP port between 1 and 65535, got {value}")
        return value

    @field_validator("admin_max_body_bytes", "admin_max_tokens", "admin_max_chunks")
    @classmethod
    def _positive_limit(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be at least 1")
        return value


class LocalSettings(_Group):
    """This machine's own data: where the embedded S3 server keeps its bucket when no store is configured."""

    data_dir: Path = Field(default_factory=default_data_dir)

    @field_validator("data_dir", mode="before")
    @classmethod
    def _data_dir_not_empty(cls, value: Any) -> Any:
        return _not_empty_path(value)


def _not_empty_path(value: Any) -> Any:
    # `Path("")` is the working directory: an empty variable must not put data wherever a tool runs.
    if isinstance(value, str) and not value.strip():
        raise ValueError("must not be empty (unset it for the default, or name a directory)")
    return value


GROUPS: tuple[type[BaseModel], ...] = (
    DataPathSettings,
    StoreCredentials,
    RoutingSettings,
    AdminSettings,
    LocalSettings,
)


def fields_of(*groups: type[BaseModel]) -> frozenset[str]:
    """The setting names of `groups`: e.g. what a vLLM tier entry may set is
    `fields_of(DataPathSettings, RoutingSettings)`."""
    return frozenset(name for group in groups for name in group.model_fields)


class Settings(
    BaseSettings, DataPathSettings, StoreCredentials, RoutingSettings, AdminSettings, LocalSettings
):
    """Every setting, from the groups above: flat names (`KVSTORE_<NAME>` in the environment, `<name>` in a
    config file) whatever group a setting belongs to; a consumer that needs one part names its group."""

    model_config = SettingsConfigDict(env_prefix="KVSTORE_", extra="forbid", populate_by_name=True)

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
    def stores(self) -> list[StoreSpec]:
        """One spec per region, local first, with names set and blanks filled from the top-level settings;
        empty when no store is configured (the embedded server)."""
        if isinstance(self.store_url, str):
            listed = [StoreSpec(url=self.store_url, name=LOCAL_REGION)] if self.store_url else []
        else:
            listed = self.store_url
        return [self._with_defaults(spec) for spec in listed]

    def _with_defaults(self, spec: StoreSpec) -> StoreSpec:
        # Only S3 stores take an endpoint and credentials; a file:// or memory:// region keeps none.
        if not spec.url.lower().startswith("s3://"):
            return spec
        update: dict[str, Any] = {
            "endpoint": spec.endpoint or self.s3_endpoint,
            "region": spec.region or self.region,
        }
        if spec.access_key is None:
            update.update(access_key=self.access_key, secret_key=self.secret_key)
        return spec.model_copy(update=update)

    @property
    def local_store_url(self) -> str:
        """The local region's URL (what a single-store tool writes to), or "" for the embedded server."""
        stores = self.stores
        return stores[0].url if stores else ""


def unknown_environment(environ: dict[str, str] | None = None) -> list[str]:
    """`KVSTORE_*` variables that name no setting (a typo is otherwise silently ignored)."""
    known = set(_OTHER_ENV)
    for name, info in Settings.model_fields.items():
        known.add(f"KVSTORE_{name.upper()}")
        if isinstance(info.validation_alias, AliasChoices):
            known.update(str(a).upper() for a in info.validation_alias.choices if isinstance(a, str))
    environ = dict(os.environ) if environ is None else environ
    return sorted(
        k
        for k in environ
        if k.upper().startswith("KVSTORE_")
        and k.upper() not in known
        and not k.upper().startswith(_OTHER_ENV_PREFIXES)
    )


def load_settings(**overrides: Any) -> Settings:
    """Build settings, turning validation errors into one ConfigError that names each bad option. Unknown
    `KVSTORE_*` environment variables are logged as a warning, each by name."""
    for name in unknown_environment():
        log.warning("ignoring %s: no kvstore setting has that name (a typo?)", name)
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except SettingsError as exc:  # a value a source could not decode (e.g. malformed JSON for a list)
        cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
        raise ConfigError(f"invalid kvstore settings: {exc}{cause}") from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid kvstore settings: {problems}") from None
