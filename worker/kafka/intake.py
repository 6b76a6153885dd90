"""Kafka consumption: the fetch loop, pause/resume against the window, rebalances, commits.

The loop keeps calling ``getmany`` even when every partition is paused, so the
member never exceeds ``max_poll_interval_ms`` and never leaves its group while
the window is full.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Iterable

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition

from worker.delivery.exactly_once import TransactionalSink
from worker.delivery.offsets import OffsetTracker
from worker.flow.breaker import CircuitBreaker
from worker.flow.window import Window
from worker.kafka.options import kafka_client_kwargs
from worker.observability import Metrics
from worker.settings import Settings

log = structlog.get_logger(__name__)

#: Called for each record given a window slot: (record, generation of its partition).
Dispatch = Callable[[ConsumerRecord[bytes, bytes], int], None]

#: Longest wait in one fetch; also bounds how late a freed slot resumes a paused partition.
_POLL_TIMEOUT_MS = 100


class Intake(ConsumerRebalanceListener):  # type: ignore[misc]
    """Owns the consumer. Records go to ``dispatch`` only once they hold a window slot."""

    def __init__(
        self,
        settings: Settings,
        window: Window,
        offsets: OffsetTracker,
        metrics: Metrics,
        breaker: CircuitBreaker,
        dispatch: Dispatch,
        *,
        txn: TransactionalSink | None = None,
    ) -> None:
        self._settings = settings
        self._window = window
        self._offsets = offsets
        self._metrics = metrics
        self._breaker = breaker
        self._dispatch = dispatch
        self._txn = txn
        self._backlog: dict[TopicPartition, deque[ConsumerRecord[bytes, bytes]]] = {}
        self._stopping = asyncio.Event()
        self._commit_lock = asyncio.Lock()
        self.running = False
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=settings.kafka.bootstrap_servers,
            group_id=settings.kafka.group_id,
            client_id=settings.kafka.client_id,
            enable_auto_commit=False,
            auto_offset_reset=settings.kafka.auto_offset_reset,
            max_poll_records=settings.kafka.max_poll_records,
            isolation_level="read_committed",
            max_poll_interval_ms=settings.kafka.max_poll_interval_ms,
            session_timeout_ms=settings.kafka.session_timeout_ms,
            heartbeat_interval_ms=max(100, settings.kafka.session_timeout_ms // 5),
            **kafka_client_kwargs(settings.kafka_auth),
        )

    async def start(self) -> None:
        self.consumer.subscribe(list(self._settings.topics.input_topics), listener=self)
        await self.consumer.start()
        self.running = True

    def request_stop(self) -> None:
        """Stop fetching and dispatching; in-flight records carry on."""
        self._stopping.set()

    async def run(self) -> None:
        """Fetch, dispatch into the window, pause what is full; until ``request_stop``."""
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
            batch = await consumer.getmany(timeout_ms=0 if all_paused else _POLL_TIMEOUT_MS)
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

    async def _wait_for_room(self, assigned: set[TopicPartition]) -> None:
        room = (
            self._breaker.wait_closed()
            if self._breaker.is_open
            else self._window.wait_for_room_any(assigned)
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_POLL_TIMEOUT_MS / 1000):
                await room

    def _dispatch_backlog(self) -> None:
        if self._breaker.is_open:
            return  # Triton is out: records stay in the backlog and in Kafka.
        for tp, queue in self._backlog.items():
            while queue and self._window.try_acquire(tp):
                record = queue.popleft()
                if self._offsets.get(tp) is None:
                    # First record since this partition was assigned: its offset is
                    # where the member starts (the committed one, or a later one
                    # when the log has gaps).
                    self._offsets.assign(tp, record.offset)
                generation = self._offsets.track(tp, record.offset)
                self._dispatch(record, generation)

    def _sync_pauses(self) -> None:
        consumer = self.consumer
        assigned = consumer.assignment()
        if self._breaker.is_open:
            full = set(assigned)
        else:
            full = {tp for tp in assigned if self._backlog.get(tp) or self._window.full_for(tp)}
        paused = consumer.paused()
        if to_pause := full - paused:
            consumer.pause(*to_pause)
        if to_resume := (paused - full) & assigned:
            consumer.resume(*to_resume)
        self._metrics.paused_partitions.set(len(full))

    # -- commits -------------------------------------------------------------

    async def commit(self, only: Iterable[TopicPartition] | None = None) -> None:
        """Commit each partition's contiguous done prefix (the lowest offset not done)."""
        if self._txn is not None:
            # exactly_once: offsets are committed inside each partition's transaction.
            await self._txn.flush(set(only) if only is not None else None)
            return
        async with self._commit_lock:
            offsets = self._offsets.commit_offsets()
            if only is not None:
                keep = set(only)
                offsets = {tp: off for tp, off in offsets.items() if tp in keep}
            if not offsets:
                return
            try:
                await self.consumer.commit(
                    {tp: OffsetAndMetadata(off, "") for tp, off in offsets.items()}
                )
            except (CommitFailedError, KafkaError) as exc:
                # Not fatal: the done offsets stay tracked and the next commit retries.
                self._metrics.commit_failures_total.inc()
                log.warning("commit_failed", error=f"{type(exc).__name__}: {exc}")
                return
            self._offsets.mark_committed(offsets)
            self._metrics.commits_total.inc()

    async def commit_loop(self) -> None:
        """Commit every ``commit_interval_ms`` and refresh the lag gauges."""
        interval_s = self._settings.kafka.commit_interval_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            await self.commit()
            self._update_lag()

    def _update_lag(self) -> None:
        for tp in self.consumer.assignment():
            highwater = self.consumer.highwater(tp)
            point = self._offsets.commit_point(tp)
            if highwater is None or point is None:
                continue
            self._metrics.consumer_lag.labels(topic=tp.topic, partition=str(tp.partition)).set(
                max(0, highwater - point)
            )

    # -- rebalance listener ----------------------------------------------------

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Stop dispatching for them, wait (bounded) for their in-flight work, commit it."""
        for tp in revoked:
            self._backlog.pop(tp, None)
        waits = [self._window.wait_empty(tp) for tp in revoked]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), self._settings.kafka.revoke_timeout_s)
        except TimeoutError:
            log.warning("revoke_drain_timeout", partitions=sorted(map(str, revoked)))
        await self.commit(only=revoked)
        for tp in revoked:
            if self._txn is not None:
                await self._txn.revoke(tp)
            # Late completions of this generation are dropped from here on.
            self._offsets.revoke(tp)
            self._metrics.forget_partition(tp.topic, tp.partition)
        self._metrics.partitions_assigned.set(len(self.consumer.assignment() - revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """Start from the committed offsets (the consumer's position); tracking starts lazily."""
        self._metrics.partitions_assigned.set(len(self.consumer.assignment()))
        if self._txn is not None:
            for tp in assigned:
                await self._txn.assign(tp)
        if assigned:
            log.info("partitions_assigned", partitions=sorted(map(str, assigned)))

    async def stop(self) -> None:
        """Leave the group and close the consumer. Idempotent."""
        self.running = False
        await self.consumer.stop()
