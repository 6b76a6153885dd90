"""The edge's vocabulary on either client: Kafka's records, partitions, offsets and errors
(aiokafka's types; librdkafka's are turned into them), and what delivery asks of the consumer.

Modules outside ``worker.kafka`` take these names from here, not from aiokafka.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from aiokafka.errors import (
    CommitFailedError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition

__all__ = [
    "CommitEdge",
    "CommitFailedError",
    "ConsumerRecord",
    "KafkaError",
    "OffsetAndMetadata",
    "SaslAuthenticationFailed",
    "TopicPartition",
    "UnsupportedSaslMechanismError",
]


class CommitEdge(Protocol):
    """What delivery needs of the consumer: assignment, end offsets, commits and seeks."""

    def assignment(self) -> set[TopicPartition]: ...

    def highwater(self, tp: TopicPartition) -> int | None: ...

    async def commit(self, offsets: Mapping[TopicPartition, OffsetAndMetadata]) -> None: ...

    async def fetch_committed(
        self, partitions: Iterable[TopicPartition]
    ) -> dict[TopicPartition, OffsetAndMetadata]:
        """The group's committed offsets (with their metadata), read from the broker now."""
        ...

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Fetch ``tp`` from ``offset`` on."""
        ...

    def owns(self, tp: TopicPartition) -> bool:
        """True while ``tp`` is assigned and no rebalance is known to be under way."""
        ...
