"""docker-compose.yml as a project on a Docker engine: up, scale, stop, down, and its state.

Always the compose file plus the stand-in override, under one fixed project name, so
that what an interrupted run left (containers, networks, volumes) is found and removed
by the next one. docker-compose 1.29 with ``--compatibility``, which applies
``deploy.replicas`` and the memory limits as ``docker compose`` v2 does.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from devtools.compose.standins import OVERRIDE_FILE
from devtools.devstack.paths import PROJECT_ROOT

PROJECT_NAME = "kafka-triton-worker-test"
#: Every service but Grafana, which has no stand-in (nothing here can run it).
SERVICES = ("kafka", "topics", "triton", "schema-registry", "worker", "prometheus")
#: The one-shot job: done means exited 0, not healthy.
ONE_SHOT = ("topics",)
_LABEL = "com.docker.compose.project"


@dataclass(frozen=True)
class ContainerState:
    """What ``docker inspect`` says of one container of the project."""

    name: str
    service: str
    status: str  # running, exited, ...
    health: str | None  # healthy, starting, unhealthy; None without a healthcheck
    exit_code: int


class ComposeProject:
    """The compose file and its stand-in override, run on the engine of ``env``."""

    def __init__(self, env: Mapping[str, str], name: str = PROJECT_NAME) -> None:
        self.env = dict(env)
        self.name = name

    def compose(self, *args: str, timeout_s: float = 300.0) -> str:
        """Run ``docker-compose ARGS`` on the project; its output, or RuntimeError."""
        argv = ["docker-compose", "--compatibility", "--project-name", self.name]
        argv += ["-f", str(PROJECT_ROOT / "docker-compose.yml"), "-f", str(OVERRIDE_FILE)]
        return _run([*argv, *args], self.env, timeout_s)

    def docker(self, *args: str, timeout_s: float = 120.0) -> str:
        """Run ``docker ARGS`` on the engine; its output, or RuntimeError."""
        return _run(["docker", *args], self.env, timeout_s)

    def up(self, timeout_s: float = 900.0) -> None:
        """``up -d --build`` of every service that can run here (all but Grafana)."""
        self.compose("up", "-d", "--build", *SERVICES, timeout_s=timeout_s)

    def build_worker(self) -> None:
        """``build worker``: the worker's image from the Dockerfile, on the Python stand-in."""
        self.compose("build", "worker", timeout_s=900.0)

    def scale_workers(self, count: int) -> None:
        """``up -d --scale worker=N``: members are added or removed, the others kept."""
        self.compose("up", "-d", "--no-recreate", "--scale", f"worker={count}", "worker")

    def down(self) -> None:
        """``down -v``: containers, networks and volumes of the project removed."""
        self.compose("down", "-v", "--remove-orphans", "--timeout", "60", timeout_s=300.0)

    def states(self) -> list[ContainerState]:
        """Every container of the project (running or not), as inspected now."""
        ids = self.docker("ps", "-aq", "--filter", f"label={_LABEL}={self.name}").split()
        if not ids:
            return []
        details: list[dict[str, Any]] = json.loads(self.docker("inspect", *ids))
        return [_state(detail) for detail in details]

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes still labelled with the project."""
        found = {"containers": [s.name for s in self.states()]}
        for kind in ("network", "volume"):
            names = self.docker(kind, "ls", "-q", "--filter", f"label={_LABEL}={self.name}")
            found[f"{kind}s"] = names.split()
        return found

    def wait_healthy(self, workers: int, timeout_s: float = 300.0) -> list[ContainerState]:
        """Poll until every service is healthy (the job exited 0) with ``workers`` workers."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = self.states()
            if _all_healthy(states, workers):
                return states
            failed = [s for s in states if s.service in ONE_SHOT and s.exit_code != 0]
            if failed or time.monotonic() > deadline:
                summary = ", ".join(f"{s.name} {s.status}/{s.health}" for s in states)
                raise RuntimeError(f"services not healthy in time: {summary}")
            time.sleep(1.0)

    def logs(self, service: str, tail: int = 40) -> str:
        """The last lines of a service's logs, for failure messages."""
        try:
            return self.compose("logs", "--no-color", "--tail", str(tail), service)
        except RuntimeError as error:
            return str(error)


def _all_healthy(states: Sequence[ContainerState], workers: int) -> bool:
    by_service: dict[str, list[ContainerState]] = {}
    for state in states:
        by_service.setdefault(state.service, []).append(state)
    if set(by_service) != set(SERVICES) or len(by_service["worker"]) != workers:
        return False
    for state in states:
        if state.service in ONE_SHOT:
            if (state.status, state.exit_code) != ("exited", 0):
                return False
        elif (state.status, state.health) != ("running", "healthy"):
            return False
    return True


def _state(detail: dict[str, Any]) -> ContainerState:
    state = detail["State"]
    health = state.get("Health")
    return ContainerState(
        name=detail["Name"].lstrip("/"),
        service=detail["Config"]["Labels"]["com.docker.compose.service"],
        status=state["Status"],
        health=health["Status"] if health else None,
        exit_code=int(state["ExitCode"]),
    )


def _run(argv: list[str], env: Mapping[str, str], timeout_s: float) -> str:
    done = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if done.returncode != 0:
        output = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {done.returncode}:\n{output}")
    return done.stdout
