"""The same local stack on a Docker engine, through testcontainers.

Used by the test fixtures only when asked for with ``DEVSTACK_DOCKER=1``: a Docker
engine that merely answers (for example the one the compose test starts) changes
nothing, since the images these need come from registries that not every machine
reaches. The local-process stack is the default and the one CI uses. The objects expose
the same surface as :class:`KafkaCluster` (one node) and :class:`TritonServer`.
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from typing import Any

from devtools.devstack.kafka import KafkaAdmin, run_sync
from devtools.devstack.paths import models_dir
from devtools.devstack.process import StartupError, free_port

KAFKA_IMAGE = "apache/kafka:4.1.1"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"  # tritonserver 2.51


def docker_available() -> bool:
    """True only when ``DEVSTACK_DOCKER=1``: containers are opt-in, never guessed."""
    return os.environ.get("DEVSTACK_DOCKER") == "1"


class ContainerKafka(KafkaAdmin):
    """A single KRaft node of the official ``apache/kafka`` image."""

    def __init__(self) -> None:
        from testcontainers.core.container import DockerContainer

        # The advertised listener must name the host port, so it is chosen up front.
        self._port = free_port()
        self._container: Any = (
            DockerContainer(KAFKA_IMAGE)
            .with_bind_ports(9092, self._port)
            .with_env("KAFKA_LISTENERS", "PLAINTEXT://:9092,CONTROLLER://:9093")
            .with_env("KAFKA_ADVERTISED_LISTENERS", f"PLAINTEXT://127.0.0.1:{self._port}")
            .with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")
            .with_env("KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS", "0")
        )

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self._port}"

    def start(self, timeout_s: float = 120.0) -> float:
        from testcontainers.core.waiting_utils import wait_container_is_ready

        self._container.start()

        @wait_container_is_ready(Exception)
        def ready() -> None:
            run_sync(lambda: self.describe_topics([]))

        ready()
        return 0.0

    def stop(self) -> None:
        self._container.stop()

    def stop_node(self, node_id: int = 1) -> None:
        self._container.get_wrapped_container().stop()

    def kill_node(self, node_id: int = 1) -> None:
        self._container.get_wrapped_container().kill()

    def start_node(self, node_id: int = 1) -> float:
        self._container.get_wrapped_container().start()
        return 0.0


class ContainerTriton:
    """The NGC ``tritonserver`` image (CPU) with the project's ``models/`` mounted."""

    def __init__(self, model_repository: Path | None = None) -> None:
        from testcontainers.core.container import DockerContainer

        repo = str(model_repository or models_dir())
        self._ports = {name: free_port() for name in ("http", "grpc", "metrics")}
        self._container: Any = (
            DockerContainer(TRITON_IMAGE)
            .with_volume_mapping(repo, "/models", "ro")
            .with_bind_ports(8000, self._ports["http"])
            .with_bind_ports(8001, self._ports["grpc"])
            .with_bind_ports(8002, self._ports["metrics"])
            .with_command("tritonserver --model-repository=/models --exit-timeout-secs=5")
        )

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self._ports['grpc']}"

    @property
    def http_address(self) -> str:
        return f"127.0.0.1:{self._ports['http']}"

    @property
    def metrics_address(self) -> str:
        return f"127.0.0.1:{self._ports['metrics']}"

    def _ready(self) -> bool:
        url = f"http://{self.http_address}/v2/health/ready"
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)

    def start(self, timeout_s: float = 300.0) -> float:
        from testcontainers.core.waiting_utils import wait_container_is_ready

        self._container.start()

        @wait_container_is_ready(Exception)
        def ready() -> None:
            if not self._ready():
                raise StartupError("triton not ready")

        ready()
        return 0.0

    def stop(self) -> None:
        self._container.stop()

    def kill(self) -> None:
        self._container.get_wrapped_container().kill()

    def restart(self) -> float:
        self._container.get_wrapped_container().restart()
        return 0.0

    def running(self) -> bool:
        self._container.get_wrapped_container().reload()
        return bool(self._container.get_wrapped_container().status == "running")
