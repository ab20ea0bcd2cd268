"""Settings: one set of names from arguments, environment and a config file; bad values name the option."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvstore.chunk import Codec
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
    assert load_settings(codec="none").codec is Codec.NONE
    assert load_settings().codec is Codec.ZSTD


def test_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "kvstore.json"
    path.write_text(json.dumps({"cache_bytes": 999, "codec": "zstd"}))
    monkeypatch.setenv("KVSTORE_CONFIG_FILE", str(path))
    settings = load_settings()
    assert settings.cache_bytes == 999 and settings.codec is Codec.ZSTD
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


# -- multi-region store_url --


def test_store_url_list_of_urls_and_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    settings = load_settings(
        store_url=[
            "s3://kv-us/prod",
            {
                "url": "s3://kv-eu/prod",
                "name": "eu",
                "endpoint": "http://10.0.0.2:9000",
                "region": "eu-west-1",
            },
            {"url": "s3://kv-ap", "access_key": "AKAP", "secret_key": "remote-secret-value"},
            "file:///mnt/replica",
        ],
        s3_endpoint="http://127.0.0.1:9000",
        access_key="AKLOCAL",
        secret_key="local-secret-value",
    )
    local, eu, ap, replica = settings.stores
    assert [s.name for s in settings.stores] == ["local", "eu", "remote-2", "remote-3"]
    assert settings.local_store_url == "s3://kv-us/prod"
    # Blanks fall back to the top-level settings; a table's own values win.
    assert local.endpoint == "http://127.0.0.1:9000" and local.access_key is not None
    assert local.access_key.get_secret_value() == "AKLOCAL"
    assert eu.endpoint == "http://10.0.0.2:9000" and eu.region == "eu-west-1"
    assert ap.secret_key is not None and ap.secret_key.get_secret_value() == "remote-secret-value"
    # Only s3:// stores take an endpoint and credentials.
    assert replica.endpoint is None and replica.access_key is None
    shown = repr(settings) + str(settings.model_dump()) + repr(settings.stores)
    assert "remote-secret-value" not in shown and "local-secret-value" not in shown


def test_single_store_url_stays_a_string() -> None:
    settings = load_settings(store_url="s3://bucket/prefix", region="eu-west-1")
    assert settings.store_url == "s3://bucket/prefix"
    assert settings.local_store_url == "s3://bucket/prefix"
    [only] = settings.stores
    assert only.name == "local" and only.region == "eu-west-1"
    assert load_settings().stores == [] and load_settings().local_store_url == ""


def test_store_url_json_list_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    stores = [
        "s3://kv-us",
        {"url": "s3://kv-eu", "name": "eu", "secret_key": "env-secret", "access_key": "AK"},
    ]
    monkeypatch.setenv("KVSTORE_STORE_URL", json.dumps(stores))
    monkeypatch.setenv("KVSTORE_REMOTE_TIMEOUT_S", "0.5")
    settings = load_settings()
    assert [s.name for s in settings.stores] == ["local", "eu"]
    assert settings.remote_timeout_s == 0.5
    assert "env-secret" not in repr(settings)


def test_store_url_json_text_as_an_option() -> None:
    # The vLLM tier hands its kv_transfer_config options to load_settings; a JSON list may come as text.
    settings = load_settings(store_url='["s3://kv-us", {"url": "s3://kv-eu", "name": "eu"}]')
    assert [(s.url, s.name) for s in settings.stores] == [("s3://kv-us", "local"), ("s3://kv-eu", "eu")]


def test_store_url_list_in_toml_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text(
        'store_url = ["s3://kv-us", { url = "s3://kv-eu", name = "eu" }]\nremote_cooldown_s = 5\n'
    )
    monkeypatch.setenv("KVSTORE_CONFIG_FILE", str(path))
    settings = load_settings()
    assert [s.name for s in settings.stores] == ["local", "eu"] and settings.remote_cooldown_s == 5


@pytest.mark.parametrize(
    ("store_url", "problem"),
    [
        (["s3://a", {"url": "s3://b", "name": "local"}], "unique"),
        (["s3://a", {"url": "s3://b", "name": "x"}, {"url": "s3://c", "name": "x"}], "unique"),
        (["s3://a", {"url": "s3://b", "name": "remote-2"}, "s3://c"], "unique"),
        ([1], "element 0"),
        (["s3://a", {"uri": "s3://b"}], "element 1"),
        (["s3://a", ""], "element 1"),
        (["s3://a", {"url": "s3://b", "access_key": "AK"}], "go together"),
        (["s3://a", {"url": "s3://b", "name": "not a label!"}], "element 1"),
        ('["s3://a", ', "JSON"),
        (5, "store_url"),
    ],
)
def test_bad_store_lists_name_the_option(store_url: object, problem: str) -> None:
    with pytest.raises(ConfigError, match="store_url") as raised:
        load_settings(store_url=store_url)
    assert problem in str(raised.value)


@pytest.mark.parametrize(
    "overrides",
    [
        {"remote_timeout_s": 0},
        {"remote_cooldown_s": -1},
        {"remote_workers": 0},
        {"remote_copy_queue_bytes": 0},
    ],
)
def test_bad_remote_settings_name_the_option(overrides: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=next(iter(overrides))):
        load_settings(**overrides)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"pin_sync_s": float("inf")}, "pin_sync_s"),
        ({"outage_cooldown_s": float("nan")}, "outage_cooldown_s"),
        ({"probe_miss_ttl_s": -1.0}, "probe_miss_ttl_s"),
        ({"load_timeout_s": 0}, "load_timeout_s"),  # a load that may not wait at all serves nothing
        ({"remote_timeout_s": 1e300}, "remote_timeout_s"),
        ({"admin_port": 99999}, "admin_port"),
        ({"admin_port": 0}, "admin_port"),
        ({"store_url": "[]"}, "store_url"),
        ({"store_url": []}, "store_url"),
        ({"admin_max_body_bytes": 0}, "admin_max_body_bytes"),
    ],
)
def test_numbers_finite_and_in_range_and_no_empty_store_list(
    overrides: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        load_settings(**overrides)


def test_every_float_setting_refuses_nan_and_infinity() -> None:
    from kvstore.config import Settings

    floats = [name for name, info in Settings.model_fields.items() if info.annotation in (float, "float")]
    assert "pin_sync_s" in floats and "outage_cooldown_s" in floats
    for name in floats:
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ConfigError, match=name):
                load_settings(**{name: bad})


def test_unknown_kvstore_variables_are_warned_by_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvstore.config import unknown_environment

    monkeypatch.setenv("KVSTORE_CACHE_BYTE", "1")
    monkeypatch.setenv("KVSTORE_CACHE_BYTES", "12345")
    monkeypatch.setenv("KVSTORE_SECRET_KEY", "x")  # an alias of secret_key
    monkeypatch.setenv("KVSTORE_CONFIG_FILE", "")
    assert unknown_environment() == ["KVSTORE_CACHE_BYTE"]
    with caplog.at_level("WARNING", logger="kvstore.config"):
        assert load_settings().cache_bytes == 12345
    assert "KVSTORE_CACHE_BYTE:" in caplog.text and "KVSTORE_CACHE_BYTES" not in caplog.text


# -- the README's configuration table, and the AWS variables


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No KVSTORE_ or AWS_ variables from the caller; XDG_DATA_HOME unset, HOME in `tmp_path`."""
    import os

    for name in list(os.environ):
        if name.startswith(("KVSTORE_", "AWS_")) or name == "XDG_DATA_HOME":
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_defaults_are_the_documented_ones(clean_env: Path) -> None:
    s = load_settings()
    assert s.store_url == "" and s.stores == []  # the embedded server
    assert s.s3_endpoint is None and s.access_key is None and s.secret_key is None and s.region is None
    assert s.cache_dir == clean_env / ".local" / "share" / "kvstore" / "cache"
    assert s.data_dir == clean_env / ".local" / "share" / "kvstore"
    assert s.cache_bytes == 50 * 2**30 and s.codec is Codec.NONE and s.direct_io is True
    assert (s.io_workers, s.disk_workers, s.upload_workers) == (16, 8, 8)
    assert s.load_timeout_s == 5 and s.outage_cooldown_s == 5
    assert (s.probe_hit_ttl_s, s.probe_miss_ttl_s) == (600, 2)
    assert s.prefetch_bytes == 256 * 2**20 and s.pin_sync_s == 60
    assert (s.admin_host, s.admin_port, s.admin_token) == ("127.0.0.1", 8750, None)
    assert s.events_endpoint == ""
    assert s.admin_max_body_bytes == 4 * 2**20 and s.admin_max_tokens == 262_144
    assert s.admin_max_chunks == 65_536
    assert (s.remote_workers, s.remote_timeout_s, s.remote_cooldown_s) == (4, 1.5, 30)
    assert s.remote_copy_queue_bytes == 256 * 2**20


def test_xdg_data_home_moves_the_default_directories(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(clean_env / "xdg"))
    assert load_settings().cache_dir == clean_env / "xdg" / "kvstore" / "cache"


def test_aws_endpoint_url_and_region(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:9000")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    settings = load_settings(store_url="s3://bucket/prefix")
    assert settings.s3_endpoint == "http://minio:9000" and settings.region == "eu-west-1"
    [local] = settings.stores
    assert (local.endpoint, local.region) == ("http://minio:9000", "eu-west-1")
    monkeypatch.setenv("KVSTORE_S3_ENDPOINT", "http://ours:9000")  # the kvstore name wins
    assert load_settings().s3_endpoint == "http://ours:9000"
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    assert load_settings().region == "ap-south-1"


@pytest.mark.parametrize(
    ("value", "urls"),
    [
        ("http://x", ["http://x"]),
        ("https://x:8/v/", ["https://x:8/v"]),
        ('["http://a", "http://b"]', ["http://a", "http://b"]),
        ("", []),
    ],
)
def test_vllm_urls_from_the_environment_one_url_or_a_json_list(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, value: str, urls: list[str]
) -> None:
    monkeypatch.setenv("KVSTORE_VLLM_URLS", value)
    assert load_settings().vllm_urls == urls


@pytest.mark.parametrize("value", ["[http://x", "ftp://x", '["http://x", 1]', "[1"])
def test_bad_vllm_urls_from_the_environment_are_a_config_error(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("KVSTORE_VLLM_URLS", value)
    with pytest.raises(ConfigError, match="vllm_urls"):
        load_settings()


@pytest.mark.parametrize("name", ["cache_dir", "data_dir"])
@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_directory_setting_is_an_error_not_the_working_directory(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(f"KVSTORE_{name.upper()}", value)
    with pytest.raises(ConfigError, match=f"{name}.*must not be empty"):
        load_settings()
    with pytest.raises(ConfigError, match=f"{name}.*must not be empty"):
        load_settings(**{name: value})


# -- the groups -------------------------------------------------------------------------------------------


def test_every_setting_belongs_to_exactly_one_group() -> None:
    from kvstore.config import GROUPS, Settings

    names = [name for group in GROUPS for name in group.model_fields]
    assert len(names) == len(set(names)) and set(names) == set(Settings.model_fields)


def test_each_groups_validators_apply_to_settings() -> None:
    from kvstore.config import GROUPS, Settings

    def function(decorator: Any) -> Any:
        return getattr(decorator.func, "__func__", decorator.func)  # classmethods come bound to their class

    inherited = Settings.__pydantic_decorators__.field_validators
    for group in GROUPS:
        for name, decorator in group.__pydantic_decorators__.field_validators.items():
            assert function(inherited[name]) is function(decorator), f"{group.__name__}.{name} is shadowed"


def test_a_vllm_tier_takes_the_data_path_and_routing_groups() -> None:
    from kvstore.config import DataPathSettings, RoutingSettings, fields_of

    tier = fields_of(DataPathSettings, RoutingSettings)
    assert tier == {
        "store_url", "s3_endpoint", "region", "cache_dir", "cache_bytes", "codec", "upload_workers",
        "upload_hold_s", "io_workers", "disk_workers", "direct_io", "direct_writes", "index_flush_s",
        "load_timeout_s", "probe_hit_ttl_s", "probe_miss_ttl_s", "outage_cooldown_s", "prefetch_bytes",
        "pin_sync_s", "remote_timeout_s", "remote_cooldown_s", "remote_workers", "remote_copy_queue_bytes",
        "object_locality",
    }  # fmt: skip
    assert not tier & {"access_key", "secret_key", "admin_token"}  # no secret is a tier option


def test_a_group_validates_on_its_own() -> None:
    from pydantic import ValidationError

    from kvstore.config import AdminSettings, DataPathSettings, LocalSettings, RoutingSettings

    assert DataPathSettings(cache_bytes=5, codec="zstd").codec.name == "ZSTD"
    assert AdminSettings(vllm_urls="http://x/").vllm_urls == ["http://x"]
    for group, bad in [
        (DataPathSettings, {"cache_bytes": 0}),
        (DataPathSettings, {"load_timeout_s": float("nan")}),
        (DataPathSettings, {"upload_hold_s": -1.0}),
        (DataPathSettings, {"cache_dir": ""}),
        (AdminSettings, {"admin_port": 0}),
        (RoutingSettings, {"object_locality": "NEAR"}),
        (LocalSettings, {"data_dir": " "}),
        (DataPathSettings, {"admin_port": 1}),  # another group's setting
    ]:
        with pytest.raises(ValidationError):
            group(**bad)


def test_settings_are_read_by_group(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.config import AdminSettings, DataPathSettings

    monkeypatch.setenv("KVSTORE_CACHE_BYTES", "777")
    monkeypatch.setenv("KVSTORE_ADMIN_PORT", "9999")
    settings = load_settings()
    assert isinstance(settings, DataPathSettings) and isinstance(settings, AdminSettings)
    assert settings.cache_bytes == 777 and settings.admin_port == 9999
