"""Static checks of compose/: every file it mounts exists, Prometheus scrapes both services, the dashboard's
queries use only metric names the code defines, the tier config matches the connector, cron parses."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from pathlib import Path, PurePosixPath
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
    assert checked >= 5
    assert doc["services"]["vllm"]["profiles"] == ["gpu"]
    admin = doc["services"]["kvstore-admin"]
    assert admin["command"][0] == "serve" and _entrypoint(COMPOSE / "kvstore.Dockerfile") == ["kvstore"]
    for name, svc in doc["services"].items():  # images are built ahead, never installed into at start-up
        assert "pip install" not in json.dumps(svc), name
        assert not any(str(v).startswith("..:") for v in svc.get("volumes", [])), f"{name} mounts the source"
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


# -- images -------------------------------------------------------------------------------------------------


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def _entrypoint(dockerfile: Path) -> list[str]:
    [value] = [rest for word, rest in _instructions(dockerfile) if word == "ENTRYPOINT"]
    parsed: list[str] = json.loads(value)
    return parsed


def _ignored(ignore_file: Path, path: str) -> bool:
    """Docker's rule: the last pattern that matches the path, or a folder above it, decides; '!' includes."""
    ignored = False
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for raw in ignore_file.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = line.lstrip("!").strip("/").replace("**/", "*")
        if any(fnmatch.fnmatch(c, pattern) for c in candidates):
            ignored = not include
    return ignored


def _builds() -> list[tuple[str, Path, Path]]:
    """(service, build context, Dockerfile) of every compose service built from this repository."""
    out = []
    for name, svc in _compose()["services"].items():
        build = svc.get("build")
        if build:
            context = (COMPOSE / build["context"]).resolve()
            out.append((name, context, context / build["dockerfile"]))
    return out


def test_images_build_from_files_their_context_holds() -> None:
    builds = _builds()
    assert {name for name, _, _ in builds} == {"kvstore-admin", "vllm"}
    for name, context, dockerfile in builds:
        assert context == ROOT and dockerfile.is_file(), name
        ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")  # BuildKit's per-Dockerfile file
        assert ignore.is_file(), f"{name}: the context would carry .venv and everything else"
        steps = _instructions(dockerfile)
        assert steps[0][0] in ("FROM", "ARG") and any(word == "FROM" for word, _ in steps)
        copied = 0
        for word, rest in steps:
            if word != "COPY":
                continue
            *sources, _dest = shlex.split(rest)
            for source in (s for s in sources if not s.startswith("--")):
                path = context / source
                assert path.exists(), f"{name}: COPY {source} does not exist in the context"
                files = [p for p in path.rglob("*.py")] if path.is_dir() else [path]
                assert files, f"{name}: COPY {source} copies nothing"
                for file in files:
                    rel = file.relative_to(context).as_posix()
                    if "__pycache__" not in rel:
                        assert not _ignored(ignore, rel), f"{name}: {rel} is copied but ignored"
                copied += 1
        assert copied >= 5, name
        assert _ignored(ignore, ".venv/bin/python") and _ignored(ignore, "tests/conftest.py")
    # Every folder setuptools maps into the kvstore package goes into both images.
    import tomllib

    mapped = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    )
    for _, _, dockerfile in builds:
        sources = {
            shlex.split(rest)[0].rstrip("/") for word, rest in _instructions(dockerfile) if word == "COPY"
        }
        assert mapped <= sources, dockerfile
    vllm = _compose()["services"]["vllm"]
    assert vllm["build"]["args"]["VLLM_IMAGE"].startswith("vllm/vllm-openai:")
    assert "/config/kv-transfer-config.json" in (COMPOSE / "vllm" / "vllm-entrypoint.sh").read_text()


def _manifests() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted((COMPOSE / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_k8s_admin_daemonset_shares_the_nodes_cache_with_the_tier() -> None:
    from typer.main import get_command

    from kvstore.admin.cli import app

    docs = _manifests()
    assert all({"apiVersion", "kind", "metadata"} <= set(d) for d in docs)
    by_kind = {d["kind"]: d for d in docs}
    assert {"DaemonSet", "CronJob", "Service"} <= set(by_kind)
    daemon = by_kind["DaemonSet"]
    pod = daemon["spec"]["template"]["spec"]
    assert (
        daemon["spec"]["selector"]["matchLabels"].items()
        <= daemon["spec"]["template"]["metadata"]["labels"].items()
    )
    [container] = pod["containers"]
    env = _env(container)
    tier = json.loads((COMPOSE / "vllm" / "kv-transfer-config.json").read_text())
    tier = tier["kv_connector_extra_config"]["secondary_tiers"][0]
    [volume] = pod["volumes"]
    [mount] = container["volumeMounts"]
    # The node's NVMe directory, at the path the vLLM pods' tier opens, with the same budget.
    assert volume["hostPath"]["path"] == mount["mountPath"] == env["KVSTORE_CACHE_DIR"] == tier["cache_dir"]
    assert mount["name"] == volume["name"] and int(env["KVSTORE_CACHE_BYTES"]) == tier["cache_bytes"]
    assert env["KVSTORE_STORE_URL"] == tier["store_url"]
    assert pod["hostPID"] is True  # writer markers are pids (see the manifest)
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert "KVSTORE_ADMIN_TOKEN" in env and json.loads(env["KVSTORE_VLLM_URLS"])
    # The same image as the GC CronJob, whose entrypoint is `kvstore`: args are subcommands.
    job = by_kind["CronJob"]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == job["image"]
    commands = set(get_command(app).commands)  # type: ignore[attr-defined]
    assert container["args"][0] in commands and job["args"][0] in commands
    service = by_kind["Service"]
    assert service["spec"]["selector"] == daemon["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]
