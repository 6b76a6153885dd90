"""What the tests use of the session's servers, whichever way they run.

The session fixtures (``stack``, ``kafka``, ``triton`` in tests/conftest.py) are
local processes (devstack's ``KafkaCluster`` and ``TritonServer``) or containers
(``ContainerKafka`` and ``ContainerTriton``); a test sees only these protocols,
which both kinds satisfy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from aiokafka.structs import TopicPartition


class KafkaUnderTest(Protocol):
    """A Kafka broker (one node) with the admin helpers of devstack's ``KafkaAdmin``."""

    @property
    def bootstrap_servers(self) -> str: ...

    async def create_topics(
        self,
        names: Sequence[str],
        partitions: int = 1,
        replication: int | None = None,
        configs: Mapping[str, str] | None = None,
    ) -> None: ...

    async def wait_for_leaders(self, names: Sequence[str], timeout_s: float = 30.0) -> None: ...

    async def describe_topics(self, names: Sequence[str]) -> list[dict[str, Any]]: ...

    async def leader(self, topic: str, partition: int, timeout_s: float = 30.0) -> int: ...

    async def committed_offsets(self, group_id: str) -> dict[TopicPartition, int]: ...

    def start(self) -> float: ...

    def stop(self) -> None: ...

    def stop_node(self, node_id: int) -> None: ...

    def kill_node(self, node_id: int) -> None: ...

    def start_node(self, node_id: int) -> float: ...


class TritonAddress(Protocol):
    """What a worker dials Triton by: ``host:port`` (or a comma-separated list of them)."""

    @property
    def grpc_address(self) -> str: ...


class TritonUnderTest(TritonAddress, Protocol):
    """A Triton server: its addresses, and stopping, killing and (re)starting it."""

    @property
    def http_address(self) -> str: ...

    @property
    def metrics_address(self) -> str: ...

    def start(self) -> float: ...

    def stop(self) -> None: ...

    def kill(self) -> None: ...

    def restart(self) -> float: ...

    def running(self) -> bool: ...


class StackUnderTest(Protocol):
    """Kafka and Triton, started side by side once per session."""

    @property
    def kafka(self) -> KafkaUnderTest: ...

    @property
    def triton(self) -> TritonUnderTest: ...
