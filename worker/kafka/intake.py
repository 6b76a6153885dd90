"""Kafka consumption: the fetch loop, pause/resume against the window, assignment events.

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
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Protocol

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import GroupAuthorizationFailedError, TopicAuthorizationFailedError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition

from worker.errors import CannotRun
from worker.flow.breaker import CircuitBreaker
from worker.flow.window import Window
from worker.kafka._compat import fetch_committed, rebalancing
from worker.observability import Metrics
from worker.settings import KafkaSettings

__all__ = ["REFUSED_CODES", "Admits", "Dispatch", "Feed", "Intake", "Rebalance", "refused"]

log = structlog.get_logger(__name__)

#: Called with the records given a window slot in one pass, in offset order per partition.
Dispatch = Callable[[list[ConsumerRecord[bytes, bytes]]], None]
#: False while a partition may not run further past its commit point (delivery's bound).
Admits = Callable[[TopicPartition], bool]

#: Longest wait in one fetch; also bounds how late a freed slot resumes a paused partition.
_POLL_TIMEOUT_MS = 100


#: Kafka's codes of a group, or a topic, refused to the client.
GROUP_AUTHORIZATION_FAILED, TOPIC_AUTHORIZATION_FAILED = 30, 29
REFUSED_CODES = frozenset({GROUP_AUTHORIZATION_FAILED, TOPIC_AUTHORIZATION_FAILED})


def refused(code: int, group_id: str, topics: Sequence[str], reason: str) -> CannotRun:
    """The error ending the worker (exit 2) when the broker refuses it its group or its
    input topics while it runs (ACLs changed since the start-up check)."""
    if code == GROUP_AUTHORIZATION_FAILED:
        return CannotRun(
            f"Kafka refused consumer group {group_id!r} to the worker ({reason}): grant its "
            "principal Describe and Read on the group, or change WORKER_GROUP_ID"
        )
    return CannotRun(
        f"Kafka refused the input topics {', '.join(topics)} to the worker ({reason}): "
        "grant its principal Describe and Read on them"
    )


class Rebalance(Protocol):
    """Told of assignment changes; the intake has already stopped dispatching revoked ones."""

    async def on_revoked(self, partitions: set[TopicPartition]) -> None: ...

    async def on_assigned(self, partitions: set[TopicPartition]) -> None: ...


class Feed:
    """What both intakes share: fetched records wait in a backlog per partition and go to
    ``dispatch`` once delivery admits them and they hold a window slot.

    The listener is given to ``start`` (it is told of assignments from the subscription
    on, and of the revocation ``stop`` makes), ``dispatch`` and ``admits`` to ``run``.
    """

    _rebalance: Rebalance
    _dispatch: Dispatch
    _admits: Admits

    def __init__(self, *, window: Window, breaker: CircuitBreaker, metrics: Metrics) -> None:
        self._window = window
        self._metrics = metrics
        self._breaker = breaker
        self._backlog: dict[TopicPartition, deque[ConsumerRecord[bytes, bytes]]] = {}
        self._turn = 0  # which partition with a backlog goes first next time
        self._stopping = asyncio.Event()
        self.running = False

    def request_stop(self) -> None:
        """Stop fetching and dispatching; in-flight records carry on."""
        self._stopping.set()

    def _dispatch_backlog(self) -> None:
        """Dispatch the backlog's records that delivery admits and that get a slot: each
        partition's in order, the partitions taking turns one record at a time from a
        starting partition that moves on every call.

        Taking each partition's backlog whole, always in the same order, let the first
        partitions refill the window every time it freed (two at their per-partition
        limit fill it), so that a partition behind them got no slot for as long as they
        had a backlog (under exactly_once, whose records hold their slots until their
        transaction commits, a final worker draining 6,000 records left two of four
        partitions uncommitted for more than 10 s).
        """
        if self._breaker.is_open:
            return  # Triton is out: records stay in the backlog and in Kafka.
        order = [tp for tp, queue in self._backlog.items() if queue]
        if not order:
            return
        start = self._turn % len(order)
        self._turn += 1
        turn = order[start:] + order[:start]
        taken: list[ConsumerRecord[bytes, bytes]] = []
        while turn:
            turn = [tp for tp in turn if self._take_one(tp, taken)]
        if taken:
            self._dispatch(taken)  # together: the worker may handle them as one batch

    def _take_one(self, tp: TopicPartition, taken: list[ConsumerRecord[bytes, bytes]]) -> bool:
        """Move ``tp``'s next record to ``taken`` if it may go; True if ``tp`` has more."""
        queue = self._backlog[tp]
        if not (self._admits(tp) and self._window.try_acquire(tp)):
            return False
        taken.append(queue.popleft())
        return bool(queue)

    def _can_take(self, tp: TopicPartition) -> bool:
        """A record of ``tp`` could be dispatched now: a slot is free and delivery admits it."""
        return not self._window.full_for(tp) and self._admits(tp)

    def _room(self, partitions: set[TopicPartition]) -> Coroutine[Any, Any, object]:
        """Returns once one of ``partitions`` can take a record (or the breaker closes)."""
        if self._breaker.is_open:
            return self._breaker.wait_closed()
        return self._window.wait_until(lambda: any(self._can_take(tp) for tp in partitions))


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
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=kafka.bootstrap_servers,
            group_id=kafka.group_id,
            client_id=kafka.client_id,
            enable_auto_commit=False,
            auto_offset_reset=kafka.auto_offset_reset,
            max_poll_records=kafka.max_poll_records,
            isolation_level="read_committed",
            max_poll_interval_ms=kafka.max_poll_interval_ms,
            session_timeout_ms=kafka.session_timeout_ms,
            heartbeat_interval_ms=max(100, kafka.session_timeout_ms // 5),
            **client_kwargs,
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
            if all_paused:
                # Nothing may be fetched: sleep until a slot that some partition can use
                # frees (or the breaker closes), for at most one poll interval, so that
                # getmany below still runs often (it is what keeps us in the group).
                await self._wait_for_room(assigned)
            batch = await self._fetch(0 if all_paused else _POLL_TIMEOUT_MS)
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
            full = {tp for tp in assigned if self._backlog.get(tp) or not self._can_take(tp)}
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
        """Commit these offsets for the group (raises the client's errors)."""
        await self.consumer.commit(dict(offsets))

    async def fetch_committed(
        self, partitions: Iterable[TopicPartition]
    ) -> dict[TopicPartition, OffsetAndMetadata]:
        """The group's committed offsets with their metadata, asked of the coordinator now."""
        return await fetch_committed(self.consumer, list(partitions))

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
