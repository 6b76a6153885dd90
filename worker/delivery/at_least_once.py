"""``at_least_once``: a record is done once the broker acknowledged its outcome.

Each partition is committed up to its lowest record not done, every commit
interval, on revocation and at shutdown. A crash redoes what was in flight and
what finished after the last commit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

import structlog
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition

from worker.delivery.base import CommitEdge, Sink, TrackingDelivery
from worker.delivery.offsets import OffsetTracker
from worker.observability import Metrics

__all__ = ["AtLeastOnce"]

log = structlog.get_logger(__name__)


class AtLeastOnce(TrackingDelivery):
    """Outcomes straight to the broker; offsets committed through the consumer."""

    def __init__(
        self,
        sink: Sink,
        offsets: OffsetTracker,
        edge: CommitEdge,
        metrics: Metrics,
        interval_s: float,
    ) -> None:
        super().__init__(offsets, edge, metrics, interval_s)
        self._sink = sink
        self._commit_lock = asyncio.Lock()

    @property
    def sink(self) -> Sink:
        return self._sink

    async def complete(
        self,
        record: ConsumerRecord[bytes, bytes],
        ticket: int,
        deliver: Callable[[], Awaitable[None]],
    ) -> None:
        await deliver()
        # Done only after the broker acknowledged the result or dead letter.
        self.offsets.done(TopicPartition(record.topic, record.partition), record.offset, ticket)

    async def commit(self, only: Iterable[TopicPartition] | None = None) -> None:
        """Commit each partition's contiguous done prefix (the lowest offset not done)."""
        async with self._commit_lock:
            offsets = self.offsets.commit_offsets()
            if only is not None:
                keep = set(only)
                offsets = {tp: off for tp, off in offsets.items() if tp in keep}
            if not offsets:
                return
            try:
                await self._edge.commit(
                    {tp: OffsetAndMetadata(off, "") for tp, off in offsets.items()}
                )
            except (CommitFailedError, KafkaError) as exc:
                # Not fatal: the done offsets stay tracked and the next commit retries.
                self._metrics.commit_failures_total.inc()
                log.warning("commit_failed", error=f"{type(exc).__name__}: {exc}")
                return
            self.offsets.mark_committed(offsets)
            self._metrics.commits_total.inc()

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        """Nothing to prepare: tracking starts with each partition's first record."""

    async def revoked(self, partitions: set[TopicPartition]) -> None:
        await self.commit(only=partitions)
        self.forget(partitions)

    async def close(self) -> None:
        """Nothing of its own to release (the publisher belongs to the worker)."""
