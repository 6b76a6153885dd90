"""The local stack: Kafka and Triton started together, for the demo, the tests and ``dev``;
with a Schema Registry beside them for the demo and ``dev up`` (the test session starts one
only when a test asks for it).

``dev up`` leaves the servers running after the command exits; their pids and
addresses live in ``run_dir()/state.json`` so that ``dev status`` and
``dev down`` can find them from another process.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devtools.devstack.kafka import KafkaCluster, ensure_kafka_jars, run_sync
from devtools.devstack.paths import models_dir, run_dir
from devtools.devstack.process import pid_alive
from devtools.devstack.registry import SchemaRegistry, ensure_registry_jar
from devtools.devstack.triton import TritonServer, ensure_triton

#: The topics `dev up` creates and the demo uses: the worker's input, output and dead letters.
DEFAULT_TOPICS = {
    "input": "inference-requests",
    "output": "inference-results",
    "dlq": "inference-dead-letters",
}
#: Partitions of the default input topic: room for a few workers to share it.
INPUT_PARTITIONS = 4


class StackRunning(RuntimeError):
    """``dev up`` found a stack already running; ``stack`` is the one recorded."""

    def __init__(self, stack: LocalStack) -> None:
        super().__init__("a local stack is already running")
        self.stack = stack


def fetch(log: Callable[[str], None] = print) -> None:
    """Download what the stack needs (Kafka jars, the Triton wheel) and build the Schema
    Registry, once; cached after."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        jars = pool.submit(ensure_kafka_jars, log)
        triton = pool.submit(ensure_triton, log)
        jars.result()
        # Maven once at a time: the registry's build shares the local Maven repository.
        ensure_registry_jar(log)
        triton.result()


@dataclass
class LocalStack:
    """A Kafka cluster and a Triton server on free local ports, data under ``workdir``;
    a Schema Registry beside them when asked for."""

    workdir: Path
    kafka: KafkaCluster
    triton: TritonServer
    registry: SchemaRegistry | None = None
    timings_s: dict[str, float] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        workdir: Path,
        *,
        kafka_nodes: int = 1,
        models: Sequence[str] | None = None,
        registry: bool = False,
        log: Callable[[str], None] = print,
    ) -> LocalStack:
        """Prepare (fetching once) but do not start; ``registry``: a Schema Registry too."""
        workdir.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max_workers=2) as pool:
            jars_job = pool.submit(ensure_kafka_jars, log)
            triton_job = pool.submit(ensure_triton, log)
            jars = jars_job.result()
            jar = ensure_registry_jar(log) if registry else None
            install = triton_job.result()
        kafka = KafkaCluster(jars, workdir / "kafka", nodes=kafka_nodes)
        triton = TritonServer(install, models_dir(), workdir / "triton", models=models)
        schemas = SchemaRegistry(jar, workdir / "registry") if jar is not None else None
        return cls(workdir, kafka, triton, schemas)

    def _servers(self) -> dict[str, Callable[[], float]]:
        starts: dict[str, Callable[[], float]] = {
            "kafka": self.kafka.start,
            "triton": self.triton.start,
        }
        if self.registry is not None:
            starts["schema registry"] = self.registry.start
        return starts

    def start(self) -> float:
        """Start the servers side by side; return the seconds until all are ready."""
        started = time.monotonic()
        servers = self._servers()
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            jobs = {name: pool.submit(start) for name, start in servers.items()}
            try:
                for name, job in jobs.items():
                    self.timings_s[name] = job.result()
            except BaseException:
                # One failed: leave nothing of the others behind.
                for job in jobs.values():
                    job.exception()
                self.stop()
                raise
        self.timings_s["total"] = time.monotonic() - started
        return self.timings_s["total"]

    def stop(self) -> None:
        """Stop every server. Idempotent."""
        stops = [self.kafka.stop, self.triton.stop]
        if self.registry is not None:
            stops.append(self.registry.stop)
        with ThreadPoolExecutor(max_workers=len(stops)) as pool:
            for job in [pool.submit(stop) for stop in stops]:
                job.result()

    def describe(self) -> dict[str, str]:
        """The addresses a user needs to connect."""
        where = {
            "kafka bootstrap": self.kafka.bootstrap_servers,
            "triton grpc": self.triton.grpc_address,
            "triton http": self.triton.http_address,
            "triton metrics": f"http://{self.triton.metrics_address}/metrics",
        }
        if self.registry is not None:
            where["schema registry"] = self.registry.url
        return where

    def create_default_topics(self) -> None:
        """Create DEFAULT_TOPICS (the input with INPUT_PARTITIONS); wait for their leaders."""
        run_sync(
            lambda: self.kafka.create_topics([DEFAULT_TOPICS["input"]], partitions=INPUT_PARTITIONS)
        )
        run_sync(
            lambda: self.kafka.create_topics(
                [DEFAULT_TOPICS["output"], DEFAULT_TOPICS["dlq"]], partitions=INPUT_PARTITIONS
            )
        )

    def worker_env(self) -> dict[str, str]:
        """The WORKER_* settings of a worker on this stack and its default topics."""
        env = {
            "WORKER_BOOTSTRAP_SERVERS": self.kafka.bootstrap_servers,
            "WORKER_TRITON_URL": self.triton.grpc_address,
            "WORKER_INPUT_TOPICS": DEFAULT_TOPICS["input"],
            "WORKER_OUTPUT_TOPIC": DEFAULT_TOPICS["output"],
            "WORKER_DLQ_TOPIC": DEFAULT_TOPICS["dlq"],
        }
        if self.registry is not None:
            env["WORKER_SCHEMA_REGISTRY_URL"] = self.registry.url
        return env

    # -- persisted state, for `dev up` / `dev status` / `dev down` ---------

    def save(self) -> Path:
        path = run_dir() / "state.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "workdir": str(self.workdir),
            "kafka": self.kafka.to_state(),
            "triton": self.triton.to_state(),
            "registry": self.registry.to_state() if self.registry is not None else None,
        }
        path.write_text(json.dumps(state, indent=2))
        return path

    @classmethod
    def load(cls) -> LocalStack | None:
        path = run_dir() / "state.json"
        if not path.exists():
            return None
        state: dict[str, Any] = json.loads(path.read_text())
        registry = state.get("registry")
        return cls(
            Path(state["workdir"]),
            KafkaCluster.from_state(state["kafka"]),
            TritonServer.from_state(state["triton"]),
            SchemaRegistry.from_state(registry) if registry else None,
        )

    def processes(self) -> list[tuple[str, int | None, bool]]:
        """(name, pid, alive) of every server process of the stack."""
        rows: list[tuple[str, int | None, bool]] = []
        for node in self.kafka.to_state()["nodes"]:
            pid = node["pid"]
            rows.append((f"kafka node {node['node_id']}", pid, pid is not None and pid_alive(pid)))
        pid = self.triton.to_state().get("pid")
        rows.append(("triton", pid, pid is not None and pid_alive(pid)))
        if self.registry is not None:
            pid = self.registry.pid
            rows.append(("schema registry", pid, pid is not None and pid_alive(pid)))
        return rows


def up(
    *, kafka_nodes: int = 1, models: Sequence[str] | None = None, log: Callable[[str], None] = print
) -> LocalStack:
    """Start a stack that outlives this process (``dev up``), with DEFAULT_TOPICS created
    and a Schema Registry beside Kafka and Triton.

    Raises StackRunning when one recorded by an earlier ``dev up`` still runs.
    """
    existing = LocalStack.load()
    if existing is not None and any(alive for _, _, alive in existing.processes()):
        raise StackRunning(existing)
    workdir = run_dir() / "stack"
    shutil.rmtree(workdir, ignore_errors=True)
    stack = LocalStack.create(
        workdir, kafka_nodes=kafka_nodes, models=models, registry=True, log=log
    )
    stack.start()
    try:
        stack.create_default_topics()
    except BaseException:
        stack.stop()
        raise
    stack.save()
    return stack


def down() -> LocalStack | None:
    """Stop a stack started by ``dev up`` and remove its data; None if none was recorded."""
    stack = LocalStack.load()
    if stack is None:
        return None
    stack.stop()
    shutil.rmtree(stack.workdir, ignore_errors=True)
    (run_dir() / "state.json").unlink(missing_ok=True)
    return stack
