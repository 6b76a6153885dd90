"""What both delivery modes share: tracking dispatched records, the commit loop, lag gauges.

A record is *tracked* when it is dispatched (in offset order), *done* once its
outcome is safe (acknowledged, or staged in a transaction that will carry its
offset), and a partition is committed up to its lowest record not done. A
partition may run at most ``max_uncommitted`` records past its commit point.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol

from worker import errors
from worker.delivery.offsets import OffsetTracker
from worker.kafka.types import CommitEdge, ConsumerRecord, TopicPartition
from worker.observability import Metrics
from worker.wire import Headers

__all__ = [
    "BatchSink",
    "CommitEdge",
    "Delivery",
    "OnSafe",
    "Publishing",
    "Refused",
    "Sink",
    "Then",
    "TrackingDelivery",
]

#: Called once a record's outcome can no longer be reordered (acked, or staged in order).
OnSafe = Callable[[], None]
#: Awaited with the indexes of the results of ``complete_many`` the broker has.
Then = Callable[[list[int]], Awaitable[None]]
#: Told of a result of ``complete_many`` kept out: its index, and why.
Refused = Callable[[int, BaseException], None]


class Sink(Protocol):
    """Where outcomes go: straight to the broker, or into a Kafka transaction.

    Each call returns once the outcome is safe: acknowledged by the broker, or
    committed in the transaction that carries the record's offset.
    """

    async def publish_result(
        self, record: ConsumerRecord[bytes, bytes], value: bytes, headers: Headers
    ) -> None: ...

    async def publish_results(
        self, record: ConsumerRecord[bytes, bytes], results: Sequence[tuple[bytes, Headers]]
    ) -> None:
        """Several results of one record (a stream's responses), in order, all or none
        visible to a ``read_committed`` reader under exactly_once."""
        ...

    async def publish_dead_letter(
        self, record: ConsumerRecord[bytes, bytes], headers: Headers
    ) -> None: ...


class BatchSink(Protocol):
    """Results of several records at once, straight to the broker."""

    async def publish_many(
        self,
        results: Sequence[tuple[ConsumerRecord[bytes, bytes], bytes, Headers]],
        *,
        enqueued: Callable[[], None] | None = None,
    ) -> list[BaseException | None]:
        """Every send enqueued (then ``enqueued()`` is called), then every ack awaited; per
        result None once acknowledged, else the error that kept it out (not retried)."""
        ...


class Publishing(Sink, BatchSink, Protocol):
    """The publisher: outcomes one record at a time, or results of several at once."""


class Delivery(Protocol):
    """When a record is done and what is committed; one implementation per mode, chosen once."""

    @property
    def sink(self) -> Sink: ...

    @property
    def offsets(self) -> OffsetTracker:
        """Each assigned partition's done offsets and commit point."""
        ...

    def track(self, record: ConsumerRecord[bytes, bytes]) -> int:
        """A record is dispatched (in offset order); returns the ticket for ``complete``."""
        ...

    def settle_if_done(self, record: ConsumerRecord[bytes, bytes], ticket: int) -> bool:
        """True (and the record is done) when the commit metadata says it was done already."""
        ...

    def admits(self, tp: TopicPartition) -> bool:
        """False while ``tp`` has run ``max_uncommitted`` records past its commit point."""
        ...

    async def complete(
        self,
        record: ConsumerRecord[bytes, bytes],
        ticket: int,
        deliver: Callable[[], Awaitable[None]],
        on_safe: OnSafe,
    ) -> None:
        """Publish the record's outcome with ``deliver`` and mark it done, in the mode's
        order; ``on_safe`` is called as soon as later records may be published."""
        ...

    async def complete_many(
        self,
        results: Sequence[tuple[ConsumerRecord[bytes, bytes], bytes, Headers]],
        tickets: Sequence[int],
        *,
        on_safe: OnSafe = lambda: None,
        on_refused: Refused = lambda _i, _e: None,
        then: Then | None = None,
    ) -> None:
        """Publish several records' results together (each partition's in the order given)
        and mark them done, per partition at once; ``tickets[i]`` is ``track``'s for
        ``results[i]``. ``on_safe`` is called once later records may be published (every
        result acknowledged, or staged in its transaction). ``on_refused(i, error)`` is
        called, as soon as it is known, for a result kept out: the caller completes its
        record alone (at_least_once left it not done; exactly_once holds its partition's
        commit below it until its dead letter is staged, so the group's other results
        wait for that). A ``PartitionRevoked`` error: the record's partition moved away.
        ``then`` is awaited with the indexes of the results the broker has (acknowledged,
        or committed) before the mode's bookkeeping ends with them (at_least_once marks
        them done after it). Returns once every result is settled; exactly_once without
        ``then`` may return once every result is staged (see its ``complete_many``), and
        tell of a refusal after that.
        """
        ...

    async def commit(self, only: Iterable[TopicPartition] | None = None) -> None:
        """Commit what is done (of ``only``, or of every partition)."""
        ...

    async def commit_loop(self) -> None:
        """Commit periodically and refresh the lag gauges until cancelled; raises a
        ``Fatal`` error when the mode cannot go on."""
        ...

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        """Partitions were assigned: prepare whatever their outcomes need."""
        ...

    async def revoked(self, partitions: set[TopicPartition], *, lost: bool = False) -> None:
        """Partitions were revoked (their in-flight records drained or abandoned): commit
        what is done (unless ``lost``: the group has moved on and refuses the commit) and
        forget them; late completions are dropped."""
        ...

    def not_ready(self) -> list[str]:
        """Partitions assigned but not yet able to take outcomes (for ``/readyz``)."""
        ...

    async def close(self) -> None:
        """Release what the mode holds (producers). Idempotent."""
        ...


class TrackingDelivery:
    """Tracking, the uncommitted bound, the periodic commit and the lag gauges."""

    def __init__(
        self,
        offsets: OffsetTracker,
        edge: CommitEdge,
        metrics: Metrics,
        interval_s: float,
        max_uncommitted: int,
    ) -> None:
        self.offsets = offsets
        self._edge = edge
        self._metrics = metrics
        self._interval_s = interval_s
        self._max_uncommitted = max_uncommitted
        self._fatal: errors.Fatal | None = None
        #: Wakes the commit loop before its interval: a fatal error, or outcomes waiting.
        self._wake = asyncio.Event()

    def track(self, record: ConsumerRecord[bytes, bytes]) -> int:
        tp = TopicPartition(record.topic, record.partition)
        if self.offsets.get(tp) is None:
            # First record since this partition was assigned: its offset is where the
            # member starts (the committed one, or a later one when the log has gaps).
            self.offsets.assign(tp, record.offset)
        return self.offsets.track(tp, record.offset)

    def settle_if_done(self, record: ConsumerRecord[bytes, bytes], ticket: int) -> bool:
        return False

    def admits(self, tp: TopicPartition) -> bool:
        state = self.offsets.get(tp)
        if state is None or state.last_tracked is None:
            return True
        point = state.commit_point()
        assert point is not None
        return state.last_tracked + 1 - point < self._max_uncommitted

    def not_ready(self) -> list[str]:
        return []

    async def commit(self, only: Iterable[TopicPartition] | None = None) -> None:
        raise NotImplementedError

    def fail(self, error: errors.Fatal) -> None:
        """The mode cannot go on (a rebalance callback cannot raise): stop the worker."""
        if self._fatal is None:
            self._fatal = error
            self._wake.set()

    def commit_soon(self) -> None:
        """Commit now rather than at the end of the interval (outcomes are waiting for it)."""
        self._wake.set()

    async def commit_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            if self._fatal is not None:
                raise self._fatal
            await self.commit()
            self._update_lag()

    def _update_lag(self) -> None:
        for tp in self._edge.assignment():
            highwater = self._edge.highwater(tp)
            point = self.offsets.commit_point(tp)
            if highwater is None or point is None:
                continue
            self._metrics.consumer_lag.labels(topic=tp.topic, partition=str(tp.partition)).set(
                max(0, highwater - point)
            )

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        """Stop tracking: late completions of these assignments are dropped from here on."""
        for tp in partitions:
            self.offsets.revoke(tp)
            self._metrics.forget_partition(tp.topic, tp.partition)
