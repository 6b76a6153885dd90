"""docker-compose.yml only sets settings the worker knows, pins images, and lets workers scale."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from worker.config import settings_env_names

pytestmark = pytest.mark.unit

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def _services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def test_worker_env_names_exist_in_the_settings_model() -> None:
    """Every WORKER_* variable the compose file sets is a real setting."""
    env = _services()["worker"]["environment"]
    unknown = {name for name in env if name not in settings_env_names()}
    assert not unknown


def test_images_are_pinned() -> None:
    """No image floats on `latest` or an absent tag."""
    for name, service in _services().items():
        if "image" in service:
            tag = service["image"].rsplit(":", 1)
            assert len(tag) == 2 and tag[1] not in {"", "latest"}, name


def test_worker_can_scale() -> None:
    """The worker has no fixed container name or host port, so `--scale worker=N` works."""
    worker = _services()["worker"]
    assert "container_name" not in worker
    assert all(":" not in str(port) for port in worker.get("ports", []))
    assert worker["deploy"]["replicas"] >= 1
