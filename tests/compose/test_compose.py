"""Static checks of compose/: every file it mounts exists, Prometheus scrapes both services, the dashboard's
queries use only metric names the code defines, the tier config matches the connector, cron parses."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
_METRIC = re.compile(r"\b((?:kvstore|vllm):[A-Za-z0-9_:]+)")
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = _load(COMPOSE / "docker-compose.yml")
    return doc


def _base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _defined_metrics() -> set[str]:
    """Every metric name string in the code that defines metrics, with exposition suffixes stripped."""
    names: set[str] = set()
    for src in (ROOT / "kvstore" / "metrics.py", ROOT / "connector" / "tier_metrics.py"):
        names |= {_base(m) for m in re.findall(r'"((?:kvstore|vllm):[A-Za-z0-9_:]+)"', src.read_text())}
    return names


def test_compose_mounts_existing_files() -> None:
    doc = _compose()
    assert {"minio", "minio-init", "kvstore-admin", "vllm", "prometheus", "grafana"} <= set(doc["services"])
    named = set(doc.get("volumes", {}))
    checked = 0
    for name, svc in doc["services"].items():
        for vol in svc.get("volumes", []):
            source = vol.split(":", 1)[0]
            if source.startswith((".", "/")):
                assert (COMPOSE / source).resolve().exists(), f"{name} mounts missing {source}"
                checked += 1
            else:
                assert source in named, f"{name} uses undeclared volume {source}"
        for dep in svc.get("depends_on", []):
            assert dep in doc["services"], f"{name} depends on unknown {dep}"
    assert checked >= 6
    assert doc["services"]["vllm"]["profiles"] == ["gpu"]
    assert "kvstore serve" in " ".join(doc["services"]["kvstore-admin"]["command"])
    init = (COMPOSE / "minio" / "minio-init.sh").read_text()
    assert "mc mb --ignore-existing local/kv-cache" in init
    assert doc["x-s3-env"]["KVSTORE_STORE_URL"].startswith("s3://kv-cache/")


def test_tier_config_names_the_connector() -> None:
    cfg = json.loads((COMPOSE / "vllm" / "kv-transfer-config.json").read_text())
    assert cfg["kv_connector"] == "OffloadingConnector"
    tier = cfg["kv_connector_extra_config"]["secondary_tiers"][0]
    assert (tier["type"], tier["module_path"]) == ("KVStoreTier", "kvstore.connector.tier")
    assert (ROOT / "connector" / "tier.py").read_text().count("class KVStoreTier") == 1
    mounted = [v for v in _compose()["services"]["vllm"]["volumes"] if v.startswith("nvme-cache:")]
    assert mounted == [f"nvme-cache:{tier['cache_dir']}"]
    assert "--kv-transfer-config" in (COMPOSE / "vllm" / "vllm-entrypoint.sh").read_text()


def test_prometheus_scrapes_both_services() -> None:
    prom = _load(COMPOSE / "prometheus.yml")
    services = _compose()["services"]
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in prom["scrape_configs"]
    }
    assert set(targets) == {"kvstore", "vllm"}
    for job, hosts in targets.items():
        for host in hosts:
            name, port = host.rsplit(":", 1)
            assert name in services, f"{job} scrapes unknown service {name}"
            published = [p.split(":")[-1] for p in services[name].get("ports", [])]
            assert port in published, f"{job} scrapes {host}, but {name} exposes {published}"


def test_grafana_provisioning_and_dashboard() -> None:
    ds = _load(COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    provider = _load(COMPOSE / "grafana" / "provisioning" / "dashboards" / "kvstore.yml")
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    dash = json.loads((COMPOSE / "grafana" / "dashboards" / "kvstore.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {_base(m) for e in exprs for m in _METRIC.findall(e)}
    defined = _defined_metrics()
    assert used and used <= defined, f"undefined metrics in the dashboard: {sorted(used - defined)}"
    # The panels the design asks for.
    for needed in (
        "kvstore:chunk_hits",
        "kvstore:chunk_queries",
        "vllm:kvstore_chunk_hits",
        "kvstore:read_seconds",
        "kvstore:nvme_used_bytes",
        "kvstore:nvme_budget_bytes",
        "kvstore:stores_dropped",
    ):
        assert needed in used
    assert any("kvstore:read_seconds_bucket" in e for e in exprs)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_gc_schedules_parse() -> None:
    lines = [
        ln
        for ln in (COMPOSE / "cron" / "kvstore-gc.cron").read_text().splitlines()
        if ln.strip() and not ln.startswith("#") and "=" not in ln.split()[0]
    ]
    assert len(lines) == 1
    fields = lines[0].split()
    assert len(fields) >= 7 and fields[6].endswith("kvstore") and fields[7] == "gc"
    job = _load(COMPOSE / "k8s" / "gc-cronjob.yaml")
    assert job["kind"] == "CronJob" and job["spec"]["schedule"] == " ".join(fields[:5])
    container = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["gc"]
