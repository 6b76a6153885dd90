"""Kafka consumption on aiokafka: the fetch loop, pausing against the window, assignments.

The loop keeps calling ``getmany`` even when every partition is paused, so the
member never exceeds ``max_poll_interval_ms`` and never leaves its group while
the window is full. The intake knows nothing of offsets or transactions: it hands
the records that took a window slot in one pass to ``dispatch``, together, and
reports assignments and revocations to its ``Rebalance`` listener (the delivery
mode decides the rest).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import structlog
from aiokafka import ConsumerRebalanceListener
from aiokafka.errors import GroupAuthorizationFailedError, TopicAuthorizationFailedError
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from worker.flow.breaker import CircuitBreaker
from worker.flow.window import Window
from worker.kafka.aiokafka import clients
from worker.kafka.aiokafka._compat import fetch_committed, rebalancing
from worker.kafka.feed import Admits, Dispatch, Feed, Rebalance, refused
from worker.observability import Metrics
from worker.settings import KafkaSettings

__all__ = ["Intake", "terminated", "unterminated"]

log = structlog.get_logger(__name__)

#: Longest wait in one fetch; also bounds how late a freed slot resumes a paused partition.
_POLL_TIMEOUT_MS = 100


def terminated(metadata: str) -> str:
    """Commit metadata as librdkafka's Python binding writes it: a C string, NUL included.

    A worker on librdkafka reads commit metadata up to the first NUL, and past the end of
    metadata that has none (``worker.kafka.rdkafka.types.metadata_of``): with the same
    terminator, what this worker commits reads back exactly on either client. Empty
    metadata stays empty (librdkafka reads it as none).
    """
    return metadata + "\x00" if metadata else metadata


def unterminated(metadata: str | None) -> str:
    """Committed metadata without the one terminating NUL librdkafka's binding (or
    ``terminated``) writes."""
    text = metadata or ""
    return text[:-1] if text.endswith("\x00") else text


class Intake(Feed, ConsumerRebalanceListener):  # type: ignore[misc]
    """Owns the consumer. Records go to ``dispatch`` only once they hold a window slot."""

    def __init__(
        self,
        kafka: KafkaSettings,
        topics: Sequence[str],
        *,
        client_kwargs: Mapping[str, Any],
        window: Window,
        breaker: CircuitBreaker,
        metrics: Metrics,
    ) -> None:
        super().__init__(window=window, breaker=breaker, metrics=metrics)
        self._topics = list(topics)
        self._group_id = kafka.group_id
        self.consumer = clients.consumer(
            kafka,
            client_kwargs,
            group_id=kafka.group_id,
            enable_auto_commit=False,
            auto_offset_reset=kafka.auto_offset_reset,
            max_poll_records=kafka.max_poll_records,
            isolation_level="read_committed",
            max_poll_interval_ms=kafka.max_poll_interval_ms,
            session_timeout_ms=kafka.session_timeout_ms,
            heartbeat_interval_ms=max(100, kafka.session_timeout_ms // 5),
        )

    async def start(self, rebalance: Rebalance) -> None:
        """Subscribe (``rebalance`` told of assignment changes) and join the group."""
        self._rebalance = rebalance
        self.consumer.subscribe(self._topics, listener=self)
        await self.consumer.start()
        self.running = True

    async def run(self, dispatch: Dispatch, admits: Admits) -> None:
        """Fetch, dispatch into the window, pause what is full; until ``request_stop``."""
        self._dispatch, self._admits = dispatch, admits
        consumer = self.consumer
        while not self._stopping.is_set():
            self._dispatch_backlog()
            self._sync_pauses()
            assigned = consumer.assignment()
            all_paused = bool(assigned) and assigned <= consumer.paused()
            no_room = bool(assigned) and not any(self._can_take(tp) for tp in assigned)
            if all_paused or no_room:
                # Nothing may be dispatched: sleep until a slot that some partition can use
                # frees (or the breaker closes), for at most one poll interval, so that
                # getmany below still runs often (it is what keeps us in the group), and
                # then take only what was prefetched meanwhile (starved partitions fetch).
                await self._wait_for_room(assigned)
            batch = await self._fetch(0 if all_paused or no_room else _POLL_TIMEOUT_MS)
            for tp, records in batch.items():
                if tp not in consumer.assignment():
                    continue
                self._metrics.records_consumed_total.labels(
                    topic=tp.topic, partition=str(tp.partition)
                ).inc(len(records))
                self._backlog.setdefault(tp, deque()).extend(records)
            # Every turn gives the loop back, even when each await above completed at once
            # (from Python 3.12 on, wait_for on a finished awaitable does not yield).
            await asyncio.sleep(0)
        self._backlog.clear()

    async def _fetch(self, timeout_ms: int) -> dict[TopicPartition, list[Any]]:
        """``getmany``; a group or topic refused to the worker ends it (CannotRun)."""
        try:
            batch: dict[TopicPartition, list[Any]] = await self.consumer.getmany(
                timeout_ms=timeout_ms
            )
        except (GroupAuthorizationFailedError, TopicAuthorizationFailedError) as exc:
            raise refused(exc.errno, self._group_id, self._topics, exc.message) from None
        return batch

    async def _wait_for_room(self, assigned: set[TopicPartition]) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_POLL_TIMEOUT_MS / 1000):
                await self._room(assigned)

    def _sync_pauses(self) -> None:
        consumer = self.consumer
        assigned = consumer.assignment()
        if self._breaker.is_open:
            full = set(assigned)
        else:
            # A partition fetches while it can take a record, or while it is starved.
            count = len(assigned)
            full = {
                tp
                for tp in assigned
                if self._backlog.get(tp)
                or not self._admits(tp)
                or not (self._can_take(tp) or self._starved(tp, count))
            }
        paused = consumer.paused()
        if to_pause := full - paused:
            consumer.pause(*to_pause)
        if to_resume := (paused - full) & assigned:
            consumer.resume(*to_resume)
        self._metrics.paused_partitions.set(len(full))

    # -- the consumer, for delivery ----------------------------------------------

    def assignment(self) -> set[TopicPartition]:
        """The partitions assigned now."""
        assigned: set[TopicPartition] = self.consumer.assignment()
        return assigned

    def highwater(self, tp: TopicPartition) -> int | None:
        """The partition's end offset as of the last fetch (None before any)."""
        end: int | None = self.consumer.highwater(tp)
        return end

    async def commit(self, offsets: Mapping[TopicPartition, OffsetAndMetadata]) -> None:
        """Commit these offsets for the group (raises the client's errors); their metadata
        as librdkafka writes it (``terminated``)."""
        await self.consumer.commit(
            {tp: OffsetAndMetadata(m.offset, terminated(m.metadata)) for tp, m in offsets.items()}
        )

    async def fetch_committed(
        self, partitions: Iterable[TopicPartition]
    ) -> dict[TopicPartition, OffsetAndMetadata]:
        """The group's committed offsets with their metadata, asked of the coordinator now
        (without the terminator librdkafka writes, ``unterminated``)."""
        found = await fetch_committed(self.consumer, list(partitions))
        return {
            tp: OffsetAndMetadata(at.offset, unterminated(at.metadata)) for tp, at in found.items()
        }

    def owns(self, tp: TopicPartition) -> bool:
        """True while ``tp`` is assigned and the consumer knows of no rebalance."""
        return tp in self.consumer.assignment() and not rebalancing(self.consumer)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Fetch ``tp`` from ``offset``; records fetched before from elsewhere are dropped."""
        self.consumer.seek(tp, offset)
        self._backlog.pop(tp, None)

    # -- rebalance listener ----------------------------------------------------

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Stop dispatching them (their fetched records are dropped), then tell the listener."""
        for tp in revoked:
            self._backlog.pop(tp, None)
        await self._rebalance.on_revoked(revoked)
        self._metrics.partitions_assigned.set(len(self.consumer.assignment() - revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """Start from the committed offsets (the consumer's position); tell the listener."""
        self._metrics.partitions_assigned.set(len(self.consumer.assignment()))
        await self._rebalance.on_assigned(assigned)
        if assigned:
            log.info("partitions_assigned", partitions=sorted(map(str, assigned)))

    async def stop(self) -> None:
        """Leave the group and close the consumer. Idempotent."""
        self.running = False
        await self.consumer.stop()
