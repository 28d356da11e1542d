"""docker-compose.yml, the Dockerfile and the Kubernetes manifests, checked without Docker or a
cluster: they parse, every file they mount exists, names and ports agree with the Prometheus
config and each other, and the image runs the package and entry point `make test` tests.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from phasewatch.cli import build_parser
from phasewatch.core.settings import Settings
from phasewatch.main import create_app
from phasewatch.slo.files import PROMETHEUS_RULE_FILE, RULES_FILE, load_spec
from phasewatch.slo.rules import prometheus_rule, render_groups
from tests.ops.conftest import DEPLOY, ROOT, SLO_FILE

K8S = DEPLOY / "k8s"


def interpolate(value: Any) -> Any:
    """Compose's `${VAR:-default}`, as it reads with none of the variables set."""
    if isinstance(value, str):
        return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)
    if isinstance(value, list):
        return [interpolate(item) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item) for key, item in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))
    assert isinstance(data, dict)
    return data


def bind_mounts(service: dict[str, Any]) -> list[tuple[Path, str]]:
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts.append(((ROOT / source).resolve(), target))
    return mounts


def local_path(service: dict[str, Any], container_path: str) -> Path:
    """Where a path inside the container comes from on this machine, through bind mounts."""
    for source, target in bind_mounts(service):
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source / container_path[len(target):].lstrip("/")
    raise AssertionError(f"{container_path} is not mounted from the repository")


def listens_on(compose: dict[str, Any], host: str) -> dict[str, int]:
    """Compose services reachable as `host`, with the port each listens on."""
    found = {}
    for name, service in compose["services"].items():
        aliases = service.get("networks", {}).get("default", {}) or {}
        if host != name and host not in aliases.get("aliases", []):
            continue
        env = service.get("environment", {})
        command = service.get("command", [])
        if "PHASEWATCH_PORT" in env:
            found[name] = int(env["PHASEWATCH_PORT"])
        elif "--port" in command:
            found[name] = int(command[command.index("--port") + 1])
        elif name == "prometheus":
            found[name] = 9090
        elif name == "postgres":
            found[name] = 5432
    return found


def test_every_mounted_file_exists(compose: dict[str, Any]) -> None:
    mounts = [m for service in compose["services"].values() for m in bind_mounts(service)]
    assert len(mounts) >= 4
    for source, _ in mounts:
        assert source.exists(), f"docker-compose.yml mounts {source}, which does not exist"


def test_engines_and_profiles(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["vllm"]["profiles"] == ["gpu"]
    assert services["vllm"]["image"].startswith("vllm/vllm-openai:")
    assert services["vllm"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] \
        == ["gpu"]
    assert services["sim"]["profiles"] == ["sim"]
    # Neither profile is needed by the rest: phasewatch, Postgres, Prometheus, Grafana always run.
    always = {name for name, service in services.items() if "profiles" not in service}
    assert always == {"phasewatch", "postgres", "prometheus", "grafana"}
    assert listens_on(compose, "engine") == {"vllm": 8000, "sim": 8000}


def test_prometheus_config_agrees_with_compose(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    config_path = local_path(prometheus, "/etc/prometheus/prometheus.yml")
    assert config_path == DEPLOY / "prometheus.yml"
    config = yaml.safe_load(config_path.read_text())
    jobs = {}
    for job in config["scrape_configs"]:
        (static,) = job["static_configs"]
        jobs[job["job_name"]] = static["targets"]
    assert load_spec(SLO_FILE).job in jobs, "the SLO file's job is not scraped"
    for job, targets in jobs.items():
        for target in targets:
            host, port = target.rsplit(":", 1)
            if host == "localhost":
                assert (job, int(port)) == ("prometheus", 9090)
                continue
            serving = listens_on(compose, host)
            assert serving, f"job {job} scrapes {host}, which no compose service answers to"
            assert set(serving.values()) == {int(port)}, (job, target, serving)
    # rule_files are relative to the config: resolved in the container, found through mounts.
    rendered = (DEPLOY / RULES_FILE).resolve()
    found = []
    for pattern in config["rule_files"]:
        container = "/etc/prometheus/" + pattern
        directory = local_path(prometheus, container.rsplit("/", 1)[0])
        found += list(directory.glob(container.rsplit("/", 1)[1]))
    assert rendered in found


def test_phasewatch_service_agrees_with_everything(compose: dict[str, Any]) -> None:
    service = compose["services"]["phasewatch"]
    env = service["environment"]
    upstream = urlsplit(env["PHASEWATCH_UPSTREAM_URL"])
    assert set(listens_on(compose, str(upstream.hostname)).values()) == {upstream.port}
    database = urlsplit(env["PHASEWATCH_DATABASE_URL"])
    assert database.scheme == "postgresql+asyncpg"
    assert listens_on(compose, str(database.hostname)) == {"postgres": database.port}
    postgres = compose["services"]["postgres"]["environment"]
    assert (database.username, database.password, database.path) == (
        postgres["POSTGRES_USER"], postgres["POSTGRES_PASSWORD"], "/" + postgres["POSTGRES_DB"])
    assert f"{env['PHASEWATCH_PORT']}:{env['PHASEWATCH_PORT']}" in service["ports"]
    spec = load_spec(SLO_FILE)
    assert float(env["PHASEWATCH_SLO_TTFT_S"]) == spec.default.ttft.threshold_s
    assert float(env["PHASEWATCH_SLO_ITL_S"]) == spec.default.itl.threshold_s
    # The settings the service sets are settings phasewatch has.
    for name in env:
        assert name.removeprefix("PHASEWATCH_").lower() in Settings.model_fields, name


def test_grafana_gets_its_provisioning_and_reaches_prometheus(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    datasources = local_path(grafana, "/etc/grafana/provisioning/datasources/prometheus.yml")
    (source,) = yaml.safe_load(datasources.read_text())["datasources"]
    url = urlsplit(source["url"])
    assert listens_on(compose, str(url.hostname)) == {"prometheus": url.port}
    providers = local_path(grafana, "/etc/grafana/provisioning/dashboards/phasewatch.yml")
    (provider,) = yaml.safe_load(providers.read_text())["providers"]
    dashboards = local_path(grafana, provider["options"]["path"])
    assert (dashboards / "phasewatch.json").exists()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert local_path(grafana, home).exists()
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["global"]["scrape_interval"]
    assert source["jsonData"]["timeInterval"] == scrape


def dockerfile() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines  # type: ignore[misc]
            if line and not line.startswith("#")]


def stages() -> dict[str, list[tuple[str, str]]]:
    """The Dockerfile's instructions per stage (`FROM ... AS name`)."""
    found: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for op, args in dockerfile():
        if op == "FROM":
            current = found.setdefault(args.split()[-1], [])
        current.append((op, args))
    return found


def test_image_builds_the_wheel_and_installs_it_locked_as_a_user() -> None:
    build, runtime = stages()["build"], stages()["runtime"]
    copied = [args.split()[0] for op, args in build if op == "COPY"]
    assert {"pyproject.toml", "app"} <= set(copied)
    assert any("python -m build --wheel" in args for op, args in build if op == "RUN")
    # The runtime stage installs the wheel (never editable) with the install script the tests
    # run (tests/test_packaging.py), from the lock, and runs as a non-root user.
    runs = " ".join(args for op, args in runtime if op == "RUN")
    assert "install-runtime.sh /opt/phasewatch /tmp/install/requirements.lock" in runs
    assert "pip install -e" not in (ROOT / "Dockerfile").read_text()
    assert [args for op, args in runtime if op == "USER"] == ["10001"]
    assert any("/api/ready" in args for op, args in runtime if op == "HEALTHCHECK")
    entrypoint = [args for op, args in runtime if op == "ENTRYPOINT"]
    cmd = [args for op, args in runtime if op == "CMD"]
    assert entrypoint == ['["phasewatch"]'] and cmd == ['["serve"]']
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"phasewatch": "phasewatch.cli:main"}
    # The commands the image, compose and the manifests run are real subcommands.
    parser = build_parser()
    for argv in (["serve"], ["sim", "--port", "8000"], ["db", "upgrade"], ["db", "current"]):
        assert parser.parse_args(argv).func is not None


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    done = subprocess.run([str(hadolint), str(ROOT / "Dockerfile")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerignore_keeps_what_the_image_copies() -> None:
    ignore = (ROOT / ".dockerignore").read_text().split()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set()
    for stage in stages().values():
        for op, args in stage:
            if op == "COPY" and "--from" not in args:
                copied.update(args.split()[:-1])
    assert copied <= kept, copied - kept


def api_paths() -> set[str]:
    """phasewatch's own routes, as its OpenAPI schema lists them (no server started)."""
    return set(create_app(Settings()).api.openapi()["paths"])


def k8s_documents() -> dict[str, dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    documents = {}
    for resource in kustomization["resources"]:
        for document in yaml.safe_load_all((K8S / resource).read_text()):
            documents[document["kind"]] = document
    return documents


def test_kubernetes_manifests_agree() -> None:
    docs = k8s_documents()
    assert set(docs) == {"Job", "Deployment", "Service", "ServiceMonitor", "PrometheusRule"}
    deployment, service, monitor = docs["Deployment"], docs["Service"], docs["ServiceMonitor"]
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = pod["spec"]["containers"]
    assert container["args"] == ["serve"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    env = {item["name"]: item for item in container["env"]}
    assert int(env["PHASEWATCH_PORT"]["value"]) == ports["http"]
    assert env["PHASEWATCH_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "phasewatch-db",
                                                                          "key": "url"}
    spec = load_spec(SLO_FILE)
    assert float(env["PHASEWATCH_SLO_TTFT_S"]["value"]) == spec.default.ttft.threshold_s
    assert float(env["PHASEWATCH_SLO_ITL_S"]["value"]) == spec.default.itl.threshold_s
    routes = api_paths()
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "http"
        assert container[probe]["httpGet"]["path"] in routes
    # Service -> pods, ServiceMonitor -> Service, and the job name the SLO rules watch.
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] == "http" and service_port["port"] == ports["http"]
    assert monitor["spec"]["selector"]["matchLabels"].items() \
        <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"] and endpoint["path"] == "/metrics"
    assert service["metadata"]["name"] == spec.job  # the operator's default job label
    # The migration Job and the waiting init container run the same image's db commands.
    (job,) = docs["Job"]["spec"]["template"]["spec"]["containers"]
    assert job["args"] == ["db", "upgrade"] and job["image"] == container["image"]
    (init,) = pod["spec"]["initContainers"]
    assert "phasewatch db current" in init["command"][-1] and init["image"] == container["image"]


def test_prometheus_rule_holds_the_rendered_groups() -> None:
    committed = yaml.safe_load((DEPLOY / PROMETHEUS_RULE_FILE).read_text())
    assert committed == prometheus_rule(render_groups(load_spec(SLO_FILE)))
    rules = yaml.safe_load((DEPLOY / RULES_FILE).read_text())
    assert rules["groups"] == committed["spec"]["groups"]


def test_alerts_point_at_a_route_phasewatch_serves() -> None:
    assert urlsplit(load_spec(SLO_FILE).diagnosis_url).path in api_paths()


def test_the_autoscaler_example_queries_what_phasewatch_exports() -> None:
    """deploy/k8s/keda-headroom.yaml scales the engine on metric names phasewatch registers
    (the requests counter, and the capacity duty's highest rate within the SLOs)."""
    from prometheus_client import CollectorRegistry

    from phasewatch.core.metrics import ProxyMetrics
    from phasewatch.plan.capacity import CapacityMetrics

    scaled = yaml.safe_load((K8S / "keda-headroom.yaml").read_text())
    assert scaled["kind"] == "ScaledObject" and scaled["spec"]["scaleTargetRef"]["name"] == "vllm"
    (trigger,) = scaled["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    registry = CollectorRegistry()
    ProxyMetrics(registry, 0.5, 0.04)
    CapacityMetrics(registry)
    exported = {sample for family in registry.collect() for sample in
                [family.name + "_total" if family.type == "counter" else family.name]}
    used = set(re.findall(r"(phasewatch_[a-z_]+)\{", query))
    assert used == {"phasewatch_requests_total", "phasewatch_slo_max_rate_rps"}
    assert used <= exported
    assert trigger["metricType"] == "AverageValue"
    assert 0 < float(trigger["metadata"]["threshold"]) <= 1
