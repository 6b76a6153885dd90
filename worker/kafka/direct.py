"""Kafka written and read without a group, as the commands beside ``run`` do.

``produce`` and ``replay`` write through a ``Writer``: an idempotent producer
(``acks=all``) whose ``send`` queues a record and returns the future of its ack.
``tail`` and ``replay`` read through a ``Reader``: partitions assigned by the caller, each
from an offset of its choice, read ``read_committed``; no group is joined and nothing is
committed, so a reader is safe beside running workers. Both clients implement them
(``worker/kafka/aiokafka/direct.py``, ``worker/kafka/rdkafka/direct.py``); the Kafka
edge builds the chosen client's (``edge.new_writer``, ``edge.new_reader``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from worker.kafka.publisher import Headers
from worker.kafka.types import ConsumerRecord, TopicPartition

__all__ = ["Reader", "Writer"]


class Writer(Protocol):
    """An idempotent producer (``acks=all``): ``start``, ``send`` records, ``stop``."""

    async def start(self) -> None:
        """Reach a broker (KafkaError when none answers; nothing is left open then)."""
        ...

    async def send(
        self, topic: str, value: bytes | None, key: bytes | None, headers: Headers | None
    ) -> asyncio.Future[Any]:
        """Queue one record; the future holds its ack, or the KafkaError that refused it.
        KafkaError when the record is refused before it is queued."""
        ...

    async def stop(self) -> None:
        """Send what is queued (bounded), then close. Idempotent."""
        ...


class Reader(Protocol):
    """A consumer without a group, reading ``read_committed`` what it is assigned."""

    async def start(self) -> None:
        """Reach a broker (KafkaError when none answers; nothing is left open then)."""
        ...

    async def offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, range]:
        """Each partition's offsets from its beginning to its end (the last stable offset:
        records of open transactions are beyond it), as the broker says now."""
        ...

    async def assign(self, starts: Mapping[TopicPartition, int]) -> None:
        """Read these partitions (and no other), each from its offset."""
        ...

    async def position(self, tp: TopicPartition) -> int:
        """The offset of the next record to be read from ``tp`` (assigned): past the
        records fetched, and past the transaction markers and aborted records skipped."""
        ...

    async def fetch(self, timeout_s: float) -> list[ConsumerRecord[bytes, bytes]]:
        """The records that came, in offset order per partition; waits up to ``timeout_s``
        for the first when none has."""
        ...

    async def stop(self) -> None:
        """Close the consumer (bounded). Idempotent."""
        ...
