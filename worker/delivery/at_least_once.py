"""``at_least_once``: a record is done once the broker acknowledged its outcome.

Each partition is committed up to its lowest record not done, with the done
offsets beyond that point in the commit's metadata (``delivery.metadata``). A
member assigned a partition reads that metadata and skips the records listed, so
a crash redoes only what was in flight and what finished after the last commit,
even when one record at the head of a partition was stuck in retries. Metadata it
could not have written is ignored (logged, counted): those records are processed again. Commits
go when a partition's commit point or done set moved, at most every commit
interval, one at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence

import structlog

from worker.delivery import metadata
from worker.delivery.base import (
    CommitEdge,
    OnSafe,
    Publishing,
    Refused,
    Sink,
    Then,
    TrackingDelivery,
)
from worker.delivery.offsets import OffsetTracker
from worker.kafka.types import (
    CommitFailedError,
    ConsumerRecord,
    KafkaError,
    OffsetAndMetadata,
    TopicPartition,
)
from worker.observability import Metrics
from worker.wire import Headers

__all__ = ["MAX_METADATA_BYTES", "AtLeastOnce"]

log = structlog.get_logger(__name__)

#: Kept under the broker's default ``offset.metadata.max.bytes`` (4096).
MAX_METADATA_BYTES = 2048


class AtLeastOnce(TrackingDelivery):
    """Outcomes straight to the broker; offsets (and done runs) committed by the consumer."""

    def __init__(
        self,
        sink: Publishing,
        offsets: OffsetTracker,
        edge: CommitEdge,
        metrics: Metrics,
        *,
        interval_s: float,
        max_uncommitted: int,
    ) -> None:
        super().__init__(offsets, edge, metrics, interval_s, max_uncommitted)
        self._sink = sink
        self._commit_lock = asyncio.Lock()
        #: What was last committed per partition: (offset, metadata).
        self._committed: dict[TopicPartition, tuple[int, str]] = {}
        #: Done runs read from the commit a partition started from.
        self._skips: dict[TopicPartition, metadata.DoneRuns] = {}

    @property
    def sink(self) -> Sink:
        return self._sink

    def settle_if_done(self, record: ConsumerRecord[bytes, bytes], ticket: int) -> bool:
        tp = TopicPartition(record.topic, record.partition)
        skip = self._skips.get(tp)
        if skip is None:
            return False
        state = self.offsets.get(tp)
        if state is None or state.start != skip.point or record.offset > skip.last:
            # Started elsewhere than the commit (a reset), or past every listed run.
            del self._skips[tp]
            return False
        if record.offset not in skip:
            return False
        self.offsets.done(tp, record.offset, ticket)
        self._metrics.records_skipped_total.inc()
        return True

    async def complete(
        self,
        record: ConsumerRecord[bytes, bytes],
        ticket: int,
        deliver: Callable[[], Awaitable[None]],
        on_safe: OnSafe,
    ) -> None:
        await deliver()
        on_safe()
        # Done only after the broker acknowledged the result or dead letter.
        self.offsets.done(TopicPartition(record.topic, record.partition), record.offset, ticket)

    async def complete_many(
        self,
        results: Sequence[tuple[ConsumerRecord[bytes, bytes], bytes, Headers]],
        tickets: Sequence[int],
        *,
        on_safe: OnSafe = lambda: None,
        on_refused: Refused = lambda _i, _e: None,
        then: Then | None = None,
    ) -> None:
        # The results are safe for ordering once enqueued: the idempotent producer writes
        # each partition's records in the order they were enqueued, so a key's or
        # partition's next records may be enqueued behind them without waiting for the
        # acks. (A result refused goes again alone, after them, as it would once acked.)
        passed = False

        def enqueued() -> None:
            nonlocal passed
            if not passed:
                passed = True
                on_safe()

        acks = await self._sink.publish_many(results, enqueued=enqueued)
        enqueued()  # when the producer could not enqueue them at all
        acked = []
        for i, ack in enumerate(acks):
            if ack is None:
                acked.append(i)
            else:
                on_refused(i, ack)
        if then is not None and acked:
            await then(acked)  # before they are done: an audit write that fails stops that
        done: dict[tuple[TopicPartition, int], list[int]] = {}
        for i in acked:
            record = results[i][0]
            tp = TopicPartition(record.topic, record.partition)
            done.setdefault((tp, tickets[i]), []).append(record.offset)
        for (tp, ticket), offsets in done.items():
            # False: the partition was revoked meanwhile; its next owner redoes the records.
            self.offsets.done_many(tp, offsets, ticket)

    async def commit(self, only: Iterable[TopicPartition] | None = None) -> None:
        """Commit each partition whose commit point or done runs moved since the last commit."""
        async with self._commit_lock:
            wanted = set(only) if only is not None else None
            offsets = {
                tp: meta
                for tp, meta in self._pending_commits().items()
                if wanted is None or tp in wanted
            }
            if not offsets:
                return
            try:
                await self._edge.commit(offsets)
            except (CommitFailedError, KafkaError) as exc:
                # Not fatal: the done offsets stay tracked and the next commit retries.
                self._metrics.commit_failures_total.inc()
                log.warning("commit_failed", error=f"{type(exc).__name__}: {exc}")
                return
            for tp, meta in offsets.items():
                self._committed[tp] = (meta.offset, meta.metadata)
            self.offsets.mark_committed({tp: meta.offset for tp, meta in offsets.items()})
            self._metrics.commits_total.inc()

    def _pending_commits(self) -> dict[TopicPartition, OffsetAndMetadata]:
        pending: dict[TopicPartition, OffsetAndMetadata] = {}
        for tp in self.offsets.assigned():
            point = self.offsets.commit_point(tp)
            if point is None:
                continue
            done = self.offsets.done_beyond_commit(tp)
            text = metadata.encode(point, done, MAX_METADATA_BYTES)
            if text is None:
                self._metrics.commit_metadata_overflows_total.inc()
                text = ""
            if self._committed.get(tp) != (point, text):
                pending[tp] = OffsetAndMetadata(point, text)
        return pending

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        """Read the commits the partitions start from: their done runs are skipped."""
        if not partitions:
            return
        try:
            committed = await self._edge.fetch_committed(partitions)
        except KafkaError as exc:
            # Without them the records are processed again: at least once still holds.
            log.warning("committed_metadata_unavailable", error=f"{type(exc).__name__}: {exc}")
            return
        for tp, meta in committed.items():
            if meta.offset < 0:
                continue
            try:
                runs = metadata.decode(
                    meta.offset,
                    meta.metadata,
                    max_ahead=self._max_uncommitted,
                    max_bytes=MAX_METADATA_BYTES,
                )
            except metadata.ForeignMetadata as exc:
                # Anyone who may commit for the group can write it: processed again instead.
                self._metrics.commit_metadata_ignored_total.inc()
                log.warning(
                    "commit_metadata_ignored",
                    partition=str(tp),
                    offset=meta.offset,
                    reason=str(exc),
                    metadata=meta.metadata[:64],
                )
                continue
            if runs.runs:
                self._skips[tp] = runs
                log.info("done_beyond_commit", partition=str(tp), records=runs.records)

    async def revoked(self, partitions: set[TopicPartition], *, lost: bool = False) -> None:
        if not lost:
            await self.commit(only=partitions)
        for tp in partitions:
            self._committed.pop(tp, None)
            self._skips.pop(tp, None)
        self.forget(partitions)

    async def close(self) -> None:
        """Nothing of its own to release (the publisher belongs to the worker)."""
