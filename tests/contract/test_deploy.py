"""deploy/: Kubernetes manifests, Prometheus config and Grafana dashboard agree with the code."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from worker.observability import METRICS_SPEC
from worker.settings import ENV_PREFIX, load_settings, settings_env_names

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "worker.json"
PROMETHEUS = DEPLOY / "prometheus"

#: Metric names as they appear in PromQL: the worker's and Triton's.
_METRIC_RE = re.compile(r"\b(?:worker|nv)_[a-z0-9_]+\b")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def dashboard_expressions() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template queries."""
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    queries = [v["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    exprs += [q["query"] if isinstance(q, dict) else q for q in queries]
    return exprs


def prometheus_expressions() -> list[str]:
    """Every PromQL expression of the Prometheus rule files."""
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def referenced_metric_names() -> set[str]:
    """The worker_* and nv_* names queried by the dashboard and the Prometheus rules."""
    text = "\n".join(dashboard_expressions() + prometheus_expressions())
    return set(_METRIC_RE.findall(text))


def base_metric_name(name: str, histograms: set[str]) -> str:
    """``x_bucket``/``x_sum``/``x_count`` of a histogram ``x`` → ``x``; other names unchanged."""
    for suffix in _HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in histograms:
            return name.removesuffix(suffix)
    return name


def _k8s(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def _by_kind() -> dict[str, dict[str, Any]]:
    """The worker's own manifests by kind (the Triton Service is looked up by name)."""
    docs = [doc for path in sorted(K8S.glob("*.yaml")) for doc in _k8s(path.name)]
    return {
        doc["kind"]: doc for doc in docs if doc.get("metadata", {}).get("name") != "triton-headless"
    }


def _named(name: str) -> dict[str, Any]:
    docs = [doc for path in sorted(K8S.glob("*.yaml")) for doc in _k8s(path.name)]
    (doc,) = [doc for doc in docs if doc.get("metadata", {}).get("name") == name]
    return doc


def _container() -> dict[str, Any]:
    containers = _by_kind()["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def _worker_env() -> dict[str, str]:
    """The worker's environment: the ConfigMap it loads plus its own `env` entries."""
    config = {k: str(v) for k, v in _by_kind()["ConfigMap"]["data"].items()}
    own = {e["name"]: str(e.get("value", "<from a reference>")) for e in _container()["env"]}
    return {**config, **own}


def test_manifests_parse_and_are_listed() -> None:
    """Every manifest parses; the kustomization lists all but the example Secret."""
    paths = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert all(_k8s(name) for name in paths)
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p for p in paths if p != "secret.yaml"]
    assert set(_by_kind()) >= {
        "ConfigMap",
        "Secret",
        "Deployment",
        "Service",
        "ScaledObject",
        "TriggerAuthentication",
    }


def test_every_worker_env_is_a_setting() -> None:
    """Every WORKER_* name in the ConfigMap and the container's env is a real setting."""
    env = _worker_env()
    assert all(name.startswith(ENV_PREFIX) for name in env)
    assert set(env) - settings_env_names() == set()


def test_configuration_loads() -> None:
    """The ConfigMap plus a password file is a valid configuration (secured, SASL_SSL)."""
    env = {**_worker_env(), "WORKER_SASL_USERNAME": "user"}
    settings = load_settings(env)
    assert settings.kafka_auth.security_protocol == "SASL_SSL"
    assert settings.kafka_auth.sasl_password_file is not None


def test_password_comes_from_the_secret() -> None:
    """The SASL password is a mounted Secret file, never a literal in the manifests."""
    env = {e["name"]: e for e in _container()["env"]}
    assert "WORKER_SASL_PASSWORD" not in env and "WORKER_SASL_PASSWORD" not in _worker_env()
    secret = _by_kind()["Secret"]
    path = Path(env["WORKER_SASL_PASSWORD_FILE"]["value"])
    mounts = {m["name"]: m for m in _container()["volumeMounts"]}
    volumes = {
        v["name"]: v for v in _by_kind()["Deployment"]["spec"]["template"]["spec"]["volumes"]
    }
    mount = next(m for m in mounts.values() if Path(m["mountPath"]) == path.parent)
    source = volumes[mount["name"]]["secret"]
    assert source["secretName"] == secret["metadata"]["name"]
    assert {"key": "password", "path": path.name} in source["items"]
    user = env["WORKER_SASL_USERNAME"]["valueFrom"]["secretKeyRef"]
    assert user == {"name": secret["metadata"]["name"], "key": "username"}


def test_ports_agree_with_the_metrics_port() -> None:
    """Container port, probes, Service and scrape annotation all use WORKER_METRICS_PORT."""
    port = int(_worker_env()["WORKER_METRICS_PORT"])
    container = _container()
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named == {"metrics": port}

    def resolve(value: int | str) -> int:
        return named[value] if isinstance(value, str) else value

    probes = {k: container[k]["httpGet"] for k in ("livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert {resolve(p["port"]) for p in probes.values()} == {port}
    service = _by_kind()["Service"]
    assert [(p["port"], resolve(p["targetPort"])) for p in service["spec"]["ports"]] == [
        (port, port)
    ]
    annotations = _by_kind()["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port


def test_service_selects_the_worker_pods() -> None:
    """The Service's selector matches the pod labels of the Deployment."""
    deployment = _by_kind()["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = _by_kind()["Service"]["spec"]["selector"]
    assert selector.items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_grace_period_outlasts_the_drain() -> None:
    """terminationGracePeriodSeconds exceeds WORKER_SHUTDOWN_TIMEOUT_S."""
    pod = _by_kind()["Deployment"]["spec"]["template"]["spec"]
    shutdown_s = float(_worker_env()["WORKER_SHUTDOWN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] > shutdown_s


def test_resources_and_non_root() -> None:
    """The container requests resources, limits memory and runs as a non-root user."""
    container = _container()
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "memory" in container["resources"]["limits"]
    pod_security = _by_kind()["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] != 0


def test_keda_scales_the_worker_group_on_its_input_topic() -> None:
    """The KEDA kafka trigger watches WORKER_GROUP_ID on WORKER_INPUT_TOPICS."""
    env = _worker_env()
    scaled = _by_kind()["ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == _by_kind()["Deployment"]["metadata"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "kafka"
    meta = trigger["metadata"]
    assert meta["consumerGroup"] == env["WORKER_GROUP_ID"]
    assert meta["topic"] == env["WORKER_INPUT_TOPICS"]
    assert meta["bootstrapServers"] == env["WORKER_BOOTSTRAP_SERVERS"]
    assert int(meta["lagThreshold"]) > 0
    auth = _by_kind()["TriggerAuthentication"]
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    secret = _by_kind()["Secret"]
    for ref in auth["spec"]["secretTargetRef"]:
        assert ref["name"] == secret["metadata"]["name"]
        assert ref["key"] in secret["stringData"]


def test_prometheus_scrapes_every_worker_and_triton() -> None:
    """Workers are found by DNS (every replica) on the metrics port; Triton on 8002."""
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    (dns,) = jobs["worker"]["dns_sd_configs"]
    assert dns == {"names": ["worker"], "type": "A", "port": 9400, "refresh_interval": "10s"}
    assert jobs["triton"]["static_configs"] == [{"targets": ["triton:8002"]}]
    assert [Path(f).name for f in config["rule_files"]] == ["alerts.yml"]


def _datasources(node: Any) -> list[dict[str, Any]]:
    """Every ``datasource`` reference anywhere in a dashboard (panels, targets, variables)."""
    if isinstance(node, list):
        return [ref for item in node for ref in _datasources(item)]
    if not isinstance(node, dict):
        return []
    own = [node["datasource"]] if isinstance(node.get("datasource"), dict) else []
    return own + [
        ref for key, value in node.items() if key != "datasource" for ref in _datasources(value)
    ]


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    """The provisioned datasource is a Prometheus; the dashboards folder is the one mounted."""
    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    providers = yaml.safe_load((provisioning / "dashboards" / "worker.yml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/etc/grafana/dashboards"
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_takes_its_datasource_as_an_input() -> None:
    """A `datasource` variable (any Prometheus) feeds every panel, target and query variable."""
    doc = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    chooser = variables["datasource"]
    assert (chooser["type"], chooser["query"]) == ("datasource", "prometheus")
    refs = _datasources(doc["panels"]) + _datasources(doc["templating"]["list"])
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    assert len(refs) >= 2 * len(panels)
    assert all(ref == {"type": "prometheus", "uid": "${datasource}"} for ref in refs)


def test_no_query_depends_on_the_scrape_job_name() -> None:
    """No panel or alert matches a `job` label: Operator and annotation scraping name it apart."""
    for expr in dashboard_expressions() + prometheus_expressions():
        assert not re.search(r"\bjob\s*(=|!=|=~|!~)", expr), expr


def test_dashboard_covers_what_operators_watch() -> None:
    """Throughput, latency, window, lag, dead letters, retries, breaker and per-worker panels."""
    doc = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in doc["panels"]}
    assert {
        "Throughput in and out",
        "End-to-end latency",
        "Inference latency by model",
        "In flight against window limit",
        "Consumer lag per partition",
        "Dead letters by code",
        "Retries by reason",
        "Circuit breaker open",
        "Records in per worker",
    } <= titles
    assert any("by (instance)" in expr for expr in dashboard_expressions())


def test_queried_worker_metrics_are_exported() -> None:
    """Every worker_* name the dashboard and alerts query is in METRICS_SPEC."""
    specs = {spec.name: spec.kind for spec in METRICS_SPEC}
    histograms = {name for name, kind in specs.items() if kind == "histogram"}
    queried = {
        base_metric_name(name, histograms)
        for name in referenced_metric_names()
        if name.startswith("worker_")
    }
    assert queried - set(specs) == set()
    assert len(queried) >= 12


def test_triton_url_names_the_headless_service() -> None:
    """WORKER_TRITON_URL is the headless Service's DNS name and port: one endpoint per pod."""
    service = _named("triton-headless")
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    host, _, port = _worker_env()["WORKER_TRITON_URL"].rpartition(":")
    assert host == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
