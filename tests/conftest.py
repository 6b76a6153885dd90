"""Shared fixtures: a real Kafka broker and a real Triton server for the whole session.

Both run as local processes started by the project's own devstack code (the
default, and what CI uses), or as containers through testcontainers when asked for
with ``DEVSTACK_DOCKER=1`` (a Docker engine that merely answers changes nothing).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest

from devtools.devstack.containers import ContainerKafka, ContainerTriton, docker_available
from devtools.devstack.kafka import KafkaCluster
from devtools.devstack.registry import SchemaRegistry, ensure_registry_jar
from devtools.devstack.stack import LocalStack
from tests.support import KafkaUnderTest, StackUnderTest, TritonUnderTest, local_kafka
from worker.triton.pool import TritonPool

#: The marker of each test folder; contract tests run with the unit tests (no servers).
_FOLDER_MARKERS = {
    "unit": ("unit",),
    "contract": ("contract", "unit"),
    "devtools": ("devtools",),
    "integration": ("integration",),
    "fault": ("fault",),
    "deploy": ("deploy",),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test by its folder (tests/<folder>/...), so a module cannot forget."""
    for item in items:
        parts = item.path.relative_to(item.config.rootpath).parts
        folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
        for name in _FOLDER_MARKERS.get(folder, ()):
            item.add_marker(name)


@dataclass(frozen=True)
class ContainerStack:
    """Kafka and Triton as containers (``DEVSTACK_DOCKER=1``)."""

    kafka: ContainerKafka
    triton: ContainerTriton


def _report(config: pytest.Config, line: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)


@pytest.fixture(scope="session")
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StackUnderTest]:
    """Kafka (one node) and Triton (every model), started side by side once per session."""
    if docker_available():
        kafka, triton = ContainerKafka(), ContainerTriton()
        kafka.start()
        try:
            triton.start()
        except BaseException:
            kafka.stop()
            raise
        yield ContainerStack(kafka, triton)
        triton.stop()
        kafka.stop()
        return
    local = LocalStack.create(tmp_path_factory.mktemp("stack"), log=lambda _: None)
    local.start()
    timings = ", ".join(f"{k} {v:.1f}s" for k, v in local.timings_s.items())
    _report(request.config, f"\nlocal stack ready: {timings}")
    yield local
    local.stop()


@pytest.fixture(scope="session")
def kafka(stack: StackUnderTest) -> KafkaUnderTest:
    """The session's Kafka: ``bootstrap_servers`` plus admin helpers."""
    return stack.kafka


@pytest.fixture(scope="session")
def triton(stack: StackUnderTest) -> TritonUnderTest:
    """The session's Triton: ``grpc_address``, ``http_address``; stop/kill/restart."""
    return stack.triton


@pytest.fixture(scope="session")
def cluster3() -> Iterator[KafkaCluster]:
    """Three KRaft nodes on this host, for leader failover (started when first asked for)."""
    with local_kafka(nodes=3) as cluster:
        yield cluster


@pytest.fixture
async def pool(triton: TritonUnderTest) -> AsyncIterator[TritonPool]:
    """A stream pool (two streams) to the session's Triton, closed after the test."""
    pool = TritonPool(triton.grpc_address, streams=2)
    await pool.start()
    yield pool
    await pool.close()


@pytest.fixture
def unique() -> str:
    """A short unique suffix for topic and group names, so tests never share state."""
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchemaRegistry]:
    """A real Schema Registry (Apicurio, Confluent's API), started the first time a test
    asks for one: most sessions never do."""
    registry = SchemaRegistry(
        ensure_registry_jar(log=lambda _: None), tmp_path_factory.mktemp("schema-registry")
    )
    registry.start()
    yield registry
    registry.stop()
