"""Kafka consumption through librdkafka (``WORKER_KAFKA_CLIENT=confluent``), as ``Intake`` does.

Same contract as ``worker.kafka.aiokafka.intake``: records go to ``dispatch`` once they hold a
window slot, full partitions are paused, and the ``Rebalance`` listener hears of
assignments and revocations (the revoke waits for the partitions' drain before
librdkafka lets them go: the callbacks run inside ``consume``, which waits).

librdkafka's consumer takes one call at a time, and a rebalance callback runs
inside ``consume``: so that no task holding a lock (a commit) waits behind
``consume`` while a revoke callback needs that lock, calls from outside the loop are
queued and run by the loop between two ``consume`` calls, a callback's own calls go
straight through, and any other call fails with CommitFailedError while a callback
runs (retried later, as after a rebalance with aiokafka), the loop stopped or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import confluent_kafka
import structlog
from aiokafka.structs import OffsetAndMetadata, TopicPartition
from confluent_kafka.aio import AIOConsumer

from worker.flow.breaker import CircuitBreaker
from worker.flow.window import Window
from worker.kafka.feed import REFUSED_CODES, Admits, Dispatch, Feed, Rebalance, refused
from worker.kafka.rdkafka.fetch import fetch
from worker.kafka.rdkafka.threads import DaemonExecutor, unless_stopped
from worker.kafka.rdkafka.types import (
    committed_of,
    from_rd_error,
    record_of,
    to_rd_offsets,
    to_rd_partitions,
    tp_of,
)
from worker.observability import Metrics

__all__ = ["RdIntake"]

log = structlog.get_logger(__name__)

_T = TypeVar("_T")

#: Wait for a first record while records flow (``fetch``); queued calls wait behind it.
_POLL_TIMEOUT_S = 0.02
#: Each consume that finds nothing doubles the next wait, up to this: an idle worker
#: polls about 10 times a second (as ``Intake`` does); a wait for room ends at a free slot.
_IDLE_POLL_TIMEOUT_S = 0.1
#: Once stopping, how long a consumer call may take before it is left behind.
_STUCK_S = 0.5
#: How often the cached end offsets (for the lag gauges) are read; bound on one
#: committed-offsets request.
_HIGHWATER_INTERVAL_S, _COMMITTED_TIMEOUT_S = 1.0, 10.0

#: True inside a rebalance callback (its calls are the consumer's own: no queueing).
_IN_CALLBACK: contextvars.ContextVar[bool] = contextvars.ContextVar("in_callback", default=False)


class RdIntake(Feed):
    """Owns the librdkafka consumer. Records go to ``dispatch`` only once they hold a slot."""

    def __init__(
        self,
        config: Mapping[str, Any],
        topics: Sequence[str],
        *,
        max_poll_records: int,
        window: Window,
        breaker: CircuitBreaker,
        metrics: Metrics,
    ) -> None:
        super().__init__(window=window, breaker=breaker, metrics=metrics)
        self._config = dict(config)
        self._topics = list(topics)
        self._group_id = str(config.get("group.id", ""))
        self._max_poll_records = max_poll_records
        self._incremental = config.get("group.protocol") == "consumer"
        self._assigned: set[TopicPartition] = set()
        self._paused: set[TopicPartition] = set()
        self._highwater: dict[TopicPartition, int] = {}
        self._highwater_at = 0.0
        self._requests: deque[tuple[Callable[[], Awaitable[Any]], asyncio.Future[Any]]] = deque()
        self._request_queued = asyncio.Event()
        self._looping = False
        self._rebalancing = False
        #: The group metadata as a rebalance callback began (valid while it runs).
        self._group_snapshot: Any = None
        self.consumer: AIOConsumer | None = None

    async def start(self, rebalance: Rebalance) -> None:
        """Subscribe (``rebalance`` told of assignment changes); the group is joined by the
        first consume."""
        self._rebalance = rebalance
        # A copy: confluent_kafka.aio rewrites the callbacks of the configuration it is given.
        config = dict(self._config)
        self.consumer = AIOConsumer(config, executor=DaemonExecutor(4, "rdkafka-consumer"))
        await self.consumer.subscribe(
            self._topics,
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        self.running = True

    @property
    def _rd(self) -> confluent_kafka.Consumer:
        assert self.consumer is not None
        return self.consumer._consumer

    async def run(self, dispatch: Dispatch, admits: Admits) -> None:
        """Fetch, dispatch into the window, pause what is full; until ``request_stop``."""
        assert self.consumer is not None
        self._dispatch, self._admits = dispatch, admits
        self._looping = True
        quiet_s = _POLL_TIMEOUT_S  # doubles with each consume that finds nothing
        try:
            while not self._stopping.is_set():
                await self._serve_requests()
                self._dispatch_backlog()
                self._sync_pauses()
                assigned = self._assigned
                all_paused = bool(assigned) and assigned <= self._paused
                # Records held for room: wait for a slot here (woken by it, or by a queued
                # call), not inside librdkafka (woken by neither): then take what came.
                held = self._held_for_room()
                if all_paused or held:
                    await self._wait_for_room(assigned if all_paused else held, quiet_s)
                    await self._serve_requests()
                    timeout_s = 0.0
                elif not self._window.in_flight and not any(self._backlog.values()):
                    timeout_s = quiet_s  # nothing to do but wait for records
                else:
                    timeout_s = _POLL_TIMEOUT_S
                fetching = fetch(self.consumer, self._fetch_budget(), timeout_s)
                if (messages := await unless_stopped(self._stopping, fetching, _STUCK_S)) is None:
                    break  # stopping while librdkafka is stuck (a broker down): left behind
                quiet_s = _POLL_TIMEOUT_S if messages else min(2 * quiet_s, _IDLE_POLL_TIMEOUT_S)
                self._take(messages)
                self._refresh_highwater()
                await asyncio.sleep(0)
        finally:
            self._looping = False
            await self._serve_requests()
            self._backlog.clear()

    def _fetch_budget(self) -> int:
        """How many records the next fetch may take: what keeps the backlog of the
        partitions still fetching within one poll, and at least one (each fetch also
        keeps the membership and runs the rebalance callbacks).

        Taking a whole poll whatever the backlog held grew it past the pause bound while
        the window was full: librdkafka drops a paused partition's prefetch and fetches
        again only about 0.5 s after its resume, so a worker draining a backlog stood
        still for 0.4 s of every second (7,600 records/s with the machine 30 % busy).
        A paused partition's backlog (bounded by the pause) is left out: counted, a
        partition stuck in the window would leave the others one record a fetch.
        """
        paused = self._paused
        held = sum(len(queue) for tp, queue in self._backlog.items() if tp not in paused)
        return max(1, self._max_poll_records - held)

    def _take(self, messages: list[Any]) -> None:
        counts: dict[TopicPartition, int] = {}
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() in REFUSED_CODES:  # else asked again every few s, forever
                    raise refused(error.code(), self._group_id, self._topics, error.str())
                if error.fatal():
                    raise from_rd_error(error)
                log.warning("consume_error", error=error.str())
                continue
            tp = TopicPartition(message.topic(), message.partition())
            if tp not in self._assigned:
                continue
            self._backlog.setdefault(tp, deque()).append(record_of(message))
            counts[tp] = counts.get(tp, 0) + 1
        for tp, count in counts.items():
            self._metrics.records_consumed_total.labels(
                topic=tp.topic, partition=str(tp.partition)
            ).inc(count)

    def _refresh_highwater(self) -> None:
        now = time.monotonic()
        if now - self._highwater_at < _HIGHWATER_INTERVAL_S:
            return
        self._highwater_at = now
        for tp in self._assigned:
            rd_tp = confluent_kafka.TopicPartition(tp.topic, tp.partition)
            with contextlib.suppress(confluent_kafka.KafkaException):
                _, high = self._rd.get_watermark_offsets(rd_tp, cached=True)
                if high >= 0:
                    self._highwater[tp] = high

    def _held_for_room(self) -> set[TopicPartition]:
        """The assigned partitions whose fetched records wait for a window slot."""
        return {tp for tp in self._assigned if self._backlog.get(tp) and not self._can_take(tp)}

    async def _wait_for_room(self, partitions: set[TopicPartition], timeout_s: float) -> None:
        waits = {
            asyncio.ensure_future(self._room(partitions)),
            asyncio.ensure_future(self._request_queued.wait()),
        }
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    def _sync_pauses(self) -> None:
        """Pause a partition once its backlog holds a full poll, resume it at half that.

        Unlike aiokafka, librdkafka drops what it had prefetched for a partition when
        it is paused and fetches it again on resume: pausing whenever a slot is
        missing (as ``Intake`` does) would fetch most records twice. So a partition
        whose window is full keeps its prefetch, and a backlog of at most about one
        poll, in memory; only the breaker pauses everything at once.
        """
        assigned = self._assigned
        if self._breaker.is_open:
            full = set(assigned)
        else:
            high, low = self._max_poll_records, self._max_poll_records // 2
            full = set()
            for tp in assigned:
                waiting = len(self._backlog.get(tp, ()))
                if waiting >= high or (tp in self._paused and waiting > low):
                    full.add(tp)
        if to_pause := full - self._paused:
            self._rd.pause(to_rd_partitions(to_pause))
        if to_resume := (self._paused - full) & assigned:
            self._rd.resume(to_rd_partitions(to_resume))
        self._paused = full
        self._metrics.paused_partitions.set(len(full))

    async def _call(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """Run a consumer call now (in a callback, or with no loop running), or queue it
        for the loop; CommitFailedError while a rebalance callback runs (inside consume: the
        call would wait for it, and it maybe for what the caller holds, a commit's lock)."""
        if _IN_CALLBACK.get():
            return await call()
        if self._rebalancing:
            raise from_rd_error("rebalance in progress", commit=True)
        if not self._looping:
            return await call()
        future: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        self._requests.append((call, future))
        self._request_queued.set()
        return await future

    async def _serve_requests(self) -> None:
        self._request_queued.clear()
        while self._requests:
            call, future = self._requests.popleft()
            if future.done():
                continue
            try:
                result = await unless_stopped(self._stopping, call(), _STUCK_S)
            except Exception as exc:  # handed to the caller
                future.set_exception(exc)
                continue
            if result is None and self._stopping.is_set():
                future.set_exception(from_rd_error("stopping", commit=True))
            else:
                future.set_result(result)

    def _fail_queued(self) -> None:
        while self._requests:
            _, future = self._requests.popleft()
            if not future.done():
                future.set_exception(from_rd_error("rebalance in progress", commit=True))

    def assignment(self) -> set[TopicPartition]:
        """The partitions assigned now."""
        return set(self._assigned)

    def highwater(self, tp: TopicPartition) -> int | None:
        """The partition's end offset as of a recent fetch (None before any)."""
        return self._highwater.get(tp)

    async def commit(self, offsets: Mapping[TopicPartition, OffsetAndMetadata]) -> None:
        """Commit these offsets (with their metadata) for the group; CommitFailedError or
        KafkaError (aiokafka's classes) when refused."""
        consumer = self.consumer
        assert consumer is not None

        async def commit_now() -> None:
            try:
                answer = await consumer.commit(offsets=to_rd_offsets(offsets), asynchronous=False)
            except confluent_kafka.KafkaException as exc:
                raise from_rd_error(exc, commit=True) from None
            for partition in answer or []:
                if partition.error is not None:
                    raise from_rd_error(partition.error, commit=True)

        await self._call(commit_now)

    async def fetch_committed(
        self, partitions: Iterable[TopicPartition]
    ) -> dict[TopicPartition, OffsetAndMetadata]:
        """The group's committed offsets with their metadata, asked of the coordinator now."""
        consumer = self.consumer
        assert consumer is not None
        asked = to_rd_partitions(partitions)

        async def committed_now() -> dict[TopicPartition, OffsetAndMetadata]:
            try:
                answer = await consumer.committed(asked, timeout=_COMMITTED_TIMEOUT_S)
            except confluent_kafka.KafkaException as exc:
                raise from_rd_error(exc) from None
            return committed_of(answer)

        return await self._call(committed_now)

    async def group_metadata(self) -> Any:
        """The consumer's group metadata (generation or member epoch, member id), for
        ``send_offsets_to_transaction``: read now, or, while a rebalance callback runs,
        as it was when the callback began (the member's generation until it returns)."""
        consumer = self.consumer
        assert consumer is not None
        if self._rebalancing and not _IN_CALLBACK.get():
            if self._group_snapshot is None:
                raise from_rd_error("rebalance in progress", commit=True)
            return self._group_snapshot
        return await self._call(consumer.consumer_group_metadata)

    def owns(self, tp: TopicPartition) -> bool:
        """True while ``tp`` is assigned and no rebalance callback is under way."""
        return tp in self._assigned and not self._rebalancing

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Fetch ``tp`` from ``offset``; records fetched before from elsewhere are dropped."""
        self._backlog.pop(tp, None)
        self._rd.seek(confluent_kafka.TopicPartition(tp.topic, tp.partition, offset))

    # -- rebalance callbacks (run inside consume, on the event loop) ---------------

    @contextlib.asynccontextmanager
    async def _callback(self, consumer: AIOConsumer) -> AsyncIterator[None]:
        """A rebalance callback's frame: queued calls fail, the callback's own go straight
        through, and the group metadata is kept as it was when the callback began."""
        token = _IN_CALLBACK.set(True)
        self._rebalancing = True
        self._group_snapshot = None
        self._fail_queued()
        try:
            # None while the consumer closes (only exactly_once asks for it, and fails then).
            with contextlib.suppress(RuntimeError, confluent_kafka.KafkaException):
                self._group_snapshot = await consumer.consumer_group_metadata()
            yield
        finally:
            self._rebalancing = False
            self._group_snapshot = None
            _IN_CALLBACK.reset(token)

    async def _on_assign(self, consumer: AIOConsumer, partitions: list[Any]) -> None:
        """Tell the listener (it reads the commits), then take the partitions; none once
        stopping (close() may rejoin first): the binding assigns them, close revokes them."""
        if self._stopping.is_set():
            return
        async with self._callback(consumer):
            assigned = {tp_of(p) for p in partitions}
            await self._rebalance.on_assigned(assigned)
            if self._incremental:
                await consumer.incremental_assign(partitions)
            else:
                await consumer.assign(partitions)
            # librdkafka may keep a partition's pause across an unassign and a new assign:
            # the loop pauses what it must again, from a known state.
            await consumer.resume(partitions)
            self._assigned |= assigned
            self._paused -= assigned
            self._metrics.partitions_assigned.set(len(self._assigned))
            if assigned:
                log.info("partitions_assigned", partitions=sorted(map(str, assigned)))

    async def _on_revoke(
        self, consumer: AIOConsumer, partitions: list[Any], *, lost: bool = False
    ) -> None:
        """Stop dispatching them, let the listener drain and commit them, then let them go."""
        async with self._callback(consumer):
            revoked = {tp_of(p) for p in partitions}
            for tp in revoked:
                self._backlog.pop(tp, None)
            await self._rebalance.on_revoked(revoked, lost=lost)
            self._assigned -= revoked
            self._paused -= revoked
            self._highwater = {tp: o for tp, o in self._highwater.items() if tp not in revoked}
            self._metrics.partitions_assigned.set(len(self._assigned))
            if self._incremental:
                await consumer.incremental_unassign(partitions)
            else:
                await consumer.unassign()

    async def _on_lost(self, consumer: AIOConsumer, partitions: list[Any]) -> None:
        """Partitions lost (the session expired): revoked without a commit (the group
        refuses it: a transaction's offsets only after a wait of seconds)."""
        log.warning("partitions_lost", partitions=sorted(str(tp_of(p)) for p in partitions))
        await self._on_revoke(consumer, partitions, lost=True)

    async def stop(self) -> None:
        """Leave the group and close the consumer. Idempotent."""
        self.running = False
        consumer = self.consumer
        if consumer is None:
            return
        try:
            # Leaving the group runs the revoke callback: its commit still needs the consumer.
            await consumer.close()
        finally:
            self.consumer = None
