"""docker-compose.yml and the Dockerfile: known settings, pinned images, healthchecks, scaling."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

from worker.settings import ENV_PREFIX, load_settings, settings_env_names

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"


def _services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def _worker_env() -> dict[str, str]:
    return {k: str(v) for k, v in _services()["worker"]["environment"].items()}


def _resolved_worker_env() -> dict[str, str]:
    """The worker's environment with `${VAR:-default}` replaced by its default."""
    return {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", v) for k, v in _worker_env().items()}


def test_worker_env_names_exist_in_the_settings_model() -> None:
    """Every WORKER_* variable the compose file sets is a real setting."""
    env = _worker_env()
    assert all(name.startswith(ENV_PREFIX) for name in env)
    assert set(env) - settings_env_names() == set()


def test_worker_env_is_a_valid_configuration() -> None:
    """The worker's environment, defaults filled in, loads as settings without error."""
    settings = load_settings(_resolved_worker_env())
    assert settings.ops.metrics_port == 9400
    assert settings.kafka.bootstrap_servers == "kafka:9092"


def test_images_are_pinned() -> None:
    """No image floats on `latest` or an absent tag."""
    images = {name: s["image"] for name, s in _services().items() if "image" in s}
    assert set(images) >= {"kafka", "topics", "triton", "worker", "prometheus", "grafana"}
    for name, image in images.items():
        repository, _, tag = image.rpartition(":")
        assert repository and "/" not in tag and tag not in {"", "latest"}, name


def test_every_service_has_a_healthcheck_or_a_reason() -> None:
    """A service without a healthcheck says why in its `x-no-healthcheck` field."""
    for name, service in _services().items():
        check = service.get("healthcheck")
        reason = service.get("x-no-healthcheck")
        assert (check is None) != (reason is None), name
        if check is not None:
            assert check["test"] and not check.get("disable", False), name
        else:
            assert isinstance(reason, str) and len(reason.split()) >= 3, name


def test_startup_order_waits_on_health() -> None:
    """Workers start after the topics job succeeded and Triton and the Schema Registry are
    healthy; topics after Kafka."""
    services = _services()
    assert services["topics"]["depends_on"] == {"kafka": {"condition": "service_healthy"}}
    assert services["worker"]["depends_on"] == {
        "topics": {"condition": "service_completed_successfully"},
        "triton": {"condition": "service_healthy"},
        "schema-registry": {"condition": "service_healthy"},
    }
    for name, service in services.items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, name
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], dependency


def test_worker_can_scale() -> None:
    """The worker has no fixed container name or host port, so `--scale worker=N` works."""
    worker = _services()["worker"]
    assert "container_name" not in worker
    assert "ports" not in worker
    assert worker["deploy"]["replicas"] >= 2
    assert [str(p) for p in worker["expose"]] == [_worker_env()["WORKER_METRICS_PORT"]]


def test_worker_healthcheck_and_grace_period_match_the_settings() -> None:
    """The healthcheck hits /healthz on the metrics port; SIGKILL comes after the drain bound."""
    worker = _services()["worker"]
    env = _worker_env()
    probe = " ".join(worker["healthcheck"]["test"])
    assert f"127.0.0.1:{env['WORKER_METRICS_PORT']}/healthz" in probe
    grace_s = int(worker["stop_grace_period"].removesuffix("s"))
    assert grace_s > float(env["WORKER_SHUTDOWN_TIMEOUT_S"])


def test_topics_job_creates_the_worker_topics() -> None:
    """The one-shot job creates exactly the input, output and dead-letter topics."""
    script = _services()["topics"]["command"][0]
    created = dict(re.findall(r"--topic (\S+) --partitions (\d+)", script))
    env = _worker_env()
    assert set(created) == {
        env["WORKER_INPUT_TOPICS"],
        env["WORKER_OUTPUT_TOPIC"],
        env["WORKER_DLQ_TOPIC"],
    }
    assert int(created[env["WORKER_INPUT_TOPICS"]]) >= _services()["worker"]["deploy"]["replicas"]


def test_triton_mounts_the_model_repository_read_only() -> None:
    """Triton serves ./models, mounted read-only, on the CPU image of tritonserver 2.51."""
    triton = _services()["triton"]
    assert "./models:/models:ro" in triton["volumes"]
    assert "--model-repository=/models" in triton["command"]
    assert triton["image"] == "nvcr.io/nvidia/tritonserver:24.10-py3"


def test_monitoring_is_provisioned() -> None:
    """Prometheus reads deploy/prometheus; Grafana gets the datasource and dashboards."""
    services = _services()
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    grafana_mounts = services["grafana"]["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana_mounts
    assert "./deploy/grafana/dashboards:/etc/grafana/dashboards:ro" in grafana_mounts
    for mount in [*services["prometheus"]["volumes"], *grafana_mounts]:
        source = mount.split(":")[0]
        assert not source.startswith("./") or (ROOT / source).exists(), mount


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def test_dockerfile_runs_as_a_non_root_user() -> None:
    """The last USER of the image is neither root nor uid 0."""
    users = [arg.split(":")[0] for op, arg in _dockerfile_instructions() if op == "USER"]
    assert users and users[-1] not in {"root", "0"}


def test_dockerfile_healthcheck_hits_healthz() -> None:
    """The image's HEALTHCHECK requests /healthz."""
    checks = [arg for op, arg in _dockerfile_instructions() if op == "HEALTHCHECK"]
    assert len(checks) == 1 and "/healthz" in checks[0]


def test_dockerfile_installs_from_the_constraints() -> None:
    """Dependencies are installed with `-c constraints.txt`, and the base image is pinned."""
    instructions = _dockerfile_instructions()
    installs = [arg for op, arg in instructions if op == "RUN" and "pip install" in arg]
    assert installs and all("-c constraints.txt" in arg for arg in installs)
    base = next(arg for op, arg in instructions if op == "ARG" and arg.startswith("PYTHON_IMAGE"))
    assert re.fullmatch(r"PYTHON_IMAGE=python:3\.11\.\d+-slim-\w+", base)


def test_dockerignore_keeps_what_the_build_needs() -> None:
    """The build context excludes caches and tests but keeps the package and its metadata."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", ".devstack", "tests"} <= ignored
    copied = {"worker", "pyproject.toml", "constraints.txt", "README.md"}
    assert copied.isdisjoint(ignored)


def test_dockerfile_installs_every_documented_mode() -> None:
    """The image installs both Kafka clients' extra (confluent) and tracing (otel)."""
    installs = [
        arg for op, arg in _dockerfile_instructions() if op == "RUN" and "pip install" in arg
    ]
    extras = {m for arg in installs for m in re.findall(r'"\.\[([\w,]+)\]"', arg)}
    assert extras and {"confluent", "otel"} <= set(next(iter(extras)).split(","))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {"confluent", "otel"} <= set(project["optional-dependencies"])


def test_the_stand_in_override_swaps_only_image_names() -> None:
    """deploy/compose-test's override changes images (and the worker's base), nothing else."""
    override = yaml.safe_load((ROOT / "deploy/compose-test/docker-compose.test.yml").read_text())
    services = _services()
    for name, changes in override["services"].items():
        if name == "worker":
            assert changes == {
                "build": {"args": {"PYTHON_IMAGE": changes["build"]["args"]["PYTHON_IMAGE"]}}
            }
        else:
            assert set(changes) == {"image"}, name
            assert changes["image"] != services[name]["image"], name
    registry = {n for n, s in services.items() if "image" in s and "build" not in s}
    assert set(override["services"]) - {"worker"} == registry - {"grafana"}
