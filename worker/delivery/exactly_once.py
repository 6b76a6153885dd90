"""``exactly_once``: outcomes and offsets of an input partition in one Kafka transaction.

Each assigned input partition gets its own transactional producer whose
transactional id names the group and the partition. aiokafka has no
group-metadata fencing (KIP-447), so fencing relies on that id and on order: a
new owner first initialises the partition's id (the broker fences the old
producer and completes or aborts its open transaction), and only then reads the
committed offset and starts fetching from it.

Outcomes are staged as records finish; every commit interval the contiguous
done prefix of each partition is written, with the next offset to consume, in one
transaction. A record's ``deliver`` returns once its transaction commits, so it
holds its window slot until then (staged outcomes are bounded by the window),
while ordering turns pass on as soon as it is staged.

A failed transaction (a result the topic refuses for its size, a broker restart, offsets
refused while the group rebalances) is aborted and its producer closed; its outcomes
stay staged, and records that finish while the producer is closed are staged as well.
The next commit starts a fresh producer and writes them all in a new transaction: the
same member redoes them at once, never waiting for a rebalance. Re-staging rather than
seeking back and processing again: no second inference, and the same on both clients.
An aborted transaction is invisible to ``read_committed`` readers, so writing its
outcomes again is still exactly once. Only a partition gone (revoked, fenced) ends its
records here; its next owner redoes them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import structlog

from worker import wire
from worker.delivery.base import CommitEdge, OnSafe, Sink, TrackingDelivery
from worker.delivery.offsets import OffsetTracker
from worker.errors import OutputTooLarge, PartitionRevoked, WriteFailed
from worker.kafka.aiokafka.transactions import PartitionProducer, ProducerFactory
from worker.kafka.publisher import dead_letter_value
from worker.kafka.transactions import Message, ProducerStartFailed
from worker.kafka.types import ConsumerRecord, TopicPartition
from worker.observability import Metrics
from worker.settings import Settings
from worker.wire import Headers
from worker.wire.headers import X_VALUE_OMITTED

__all__ = ["ExactlyOnce"]

log = structlog.get_logger(__name__)


@dataclass
class _Staged:
    record: ConsumerRecord[bytes, bytes]
    messages: list[Message]
    committed: asyncio.Future[None]
    is_result: bool  # a refusal for size turns it into a dead letter


@dataclass
class _Partition:
    producer: PartitionProducer
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # producer started, or gone
    staged: dict[int, _Staged] = field(default_factory=dict)
    #: Offsets whose outcome was refused and awaits its replacement (a dead letter).
    replacing: set[int] = field(default_factory=set)


class ExactlyOnce(TrackingDelivery):
    """The exactly_once mode: stage outcomes per partition, commit them with their offsets."""

    def __init__(
        self,
        settings: Settings,
        offsets: OffsetTracker,
        edge: CommitEdge,
        metrics: Metrics,
        *,
        new_producer: ProducerFactory,
        owns: Callable[[TopicPartition], bool] = lambda _: True,
    ) -> None:
        super().__init__(
            offsets,
            edge,
            metrics,
            settings.kafka.commit_interval_ms / 1000,
            settings.delivery.max_uncommitted_per_partition,
        )
        self._settings = settings
        #: Makes a partition's producer for its transactional id (a seam of the unit tests).
        self._producer = new_producer
        self._owns = owns
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._on_staged: dict[tuple[TopicPartition, int], OnSafe] = {}
        #: Partitions dropped while still assigned (fenced): the generation and the reason.
        #: Their records end at once instead of waiting for the revocation, which itself
        #: waits for them. One entry per assigned partition at most, gone when forgotten.
        self._released: dict[TopicPartition, tuple[int, str]] = {}
        # Set (and replaced) when a partition is added or dropped, or its tracking forgotten.
        self._changed = asyncio.Event()

    @property
    def sink(self) -> Sink:
        return self

    def not_ready(self) -> list[str]:
        return sorted(str(tp) for tp, p in self._partitions.items() if not p.ready.is_set())

    # -- records -------------------------------------------------------------------

    async def complete(
        self,
        record: ConsumerRecord[bytes, bytes],
        ticket: int,
        deliver: Callable[[], Awaitable[None]],
        on_safe: OnSafe,
    ) -> None:
        tp = TopicPartition(record.topic, record.partition)
        part = await self._partition_of(tp, ticket)
        await part.ready.wait()
        # Only a partition gone (revoked, fenced, unusable) ends the record here. A producer
        # closed after a failed transaction does not: the outcome is staged all the same,
        # and the next flush starts a fresh producer for it.
        if self._partitions.get(tp) is not part:
            raise PartitionRevoked(str(tp))
        if not self.offsets.done(tp, record.offset, ticket):
            raise PartitionRevoked(str(tp))
        # Done when staged (deliver stages it before its first pause); deliver returns
        # once the transaction carrying the outcome and the offset has committed.
        self._on_staged[(tp, record.offset)] = on_safe
        try:
            await deliver()
        finally:
            self._on_staged.pop((tp, record.offset), None)

    async def _partition_of(self, tp: TopicPartition, ticket: int) -> _Partition:
        """The record's partition state; PartitionRevoked once the record's assignment ended.

        Records can be fetched before the assignment callback has created the state:
        they wait for it (never for a partition that has moved away meanwhile).
        """
        while tp not in self._partitions and self.offsets.generation(tp) == ticket:
            released = self._released.get(tp)
            if released is not None and released[0] == ticket:
                raise PartitionRevoked(f"{tp}: {released[1]}")
            await self._changed.wait()
        part = self._partitions.get(tp)
        if part is None or self.offsets.generation(tp) != ticket:
            raise PartitionRevoked(str(tp))
        return part

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # -- the sink --------------------------------------------------------------------

    async def publish_result(
        self, record: ConsumerRecord[bytes, bytes], value: bytes, headers: Headers
    ) -> None:
        topic = self._settings.topics.output_topic
        await self._stage(record, [(topic, value, record.key, headers)], is_result=True)

    async def publish_results(
        self, record: ConsumerRecord[bytes, bytes], results: Sequence[tuple[bytes, Headers]]
    ) -> None:
        topic = self._settings.topics.output_topic
        messages: list[Message] = [(topic, v, record.key, h) for v, h in results]
        await self._stage(record, messages, is_result=True)

    async def publish_dead_letter(
        self, record: ConsumerRecord[bytes, bytes], headers: Headers
    ) -> None:
        value = dead_letter_value(record.value, record.key)
        topic = self._settings.topics.dlq_topic
        await self._stage(record, [(topic, value, record.key, headers)], is_result=False)

    async def _stage(
        self, record: ConsumerRecord[bytes, bytes], messages: list[Message], *, is_result: bool
    ) -> None:
        tp = TopicPartition(record.topic, record.partition)
        part = self._partitions.get(tp)
        if part is None:
            raise PartitionRevoked(str(tp))
        assert record.offset not in part.staged, f"{tp}@{record.offset} staged twice"
        part.replacing.discard(record.offset)
        staged = _Staged(record, messages, asyncio.get_running_loop().create_future(), is_result)
        part.staged[record.offset] = staged
        on_staged = self._on_staged.pop((tp, record.offset), None)
        if on_staged is not None:
            on_staged()
        await staged.committed

    # -- commits ---------------------------------------------------------------------

    async def commit(self, only: Iterable[TopicPartition] | None = None) -> None:
        """Commit each partition's staged done prefix with its offset, one transaction each."""
        wanted = set(only) if only is not None else None
        for tp, part in list(self._partitions.items()):
            if wanted is None or tp in wanted:
                await self._flush(tp, part)

    async def _flush(self, tp: TopicPartition, part: _Partition) -> None:
        async with part.producer.lock:
            if self._partitions.get(tp) is not part or not part.ready.is_set():
                return
            point = self.offsets.commit_point(tp)
            if point is None:
                return
            # A refused outcome holds the commit until its dead letter is staged.
            point = min([point, *part.replacing])
            ready = sorted(o for o in part.staged if o < point)
            if not ready:
                return
            if not part.producer.running:
                if not self._owns(tp):
                    return  # a rebalance is deciding; the revocation cleans up
                await self._restart(tp, part)
                if not part.producer.running:
                    return
            messages = [m for o in ready for m in part.staged[o].messages]
            outcome = await part.producer.run_transaction(messages, point)
            if outcome.fenced:
                self._drop(tp, part, "fenced by the partition's new owner")
                return
            if outcome.too_large:
                self._replace_refused(part, ready, outcome.too_large)
                return
            if not outcome.committed:
                self._metrics.commit_failures_total.inc()
                return  # staged outcomes stay; the next flush tries again
        for offset in ready:
            staged = part.staged.pop(offset)
            if not staged.committed.done():
                staged.committed.set_result(None)
        self.offsets.mark_committed({tp: point})
        self._metrics.transactions_total.inc()
        self._metrics.commits_total.inc()

    def _replace_refused(
        self, part: _Partition, ready: list[int], refused: tuple[int, ...]
    ) -> None:
        """Outcomes the broker refused for size: results become OUTPUT_TOO_LARGE dead
        letters (through the record's own path), dead letters lose their value."""
        index_of: list[int] = [o for o in ready for _ in part.staged[o].messages]
        for offset in sorted({index_of[i] for i in refused}):
            staged = part.staged[offset]
            if staged.is_result:
                del part.staged[offset]
                part.replacing.add(offset)
                staged.committed.set_exception(
                    OutputTooLarge(f"result of {staged.record.topic}@{offset} is larger than "
                                   f"{self._settings.topics.output_topic!r} accepts")
                )  # fmt: skip
            else:
                staged.messages = [self._slimmer(staged, m) for m in staged.messages]

    def _slimmer(self, staged: _Staged, message: Message) -> Message:
        topic, value, key, headers = message
        omitted = any(name == X_VALUE_OMITTED for name, _ in headers)
        if omitted and key is None:
            error = WriteFailed(
                f"{topic!r} refuses the dead letter of {wire.Source.of(staged.record)} even "
                "without its value and key; raise the topic's max.message.bytes"
            )
            staged.committed.set_exception(error)
            self.fail(error)
            return message
        self._metrics.dead_letter_values_omitted_total.inc()
        slim_headers = wire.omitted_value_headers(headers, value, key, drop_key=omitted)
        return (topic, b"", None if omitted else key, slim_headers)

    # -- assignment ------------------------------------------------------------------

    def transactional_id(self, tp: TopicPartition) -> str:
        """Stable per group and input partition, so a new owner fences the old one."""
        s = self._settings
        return f"{s.delivery.transactional_id_prefix}-{s.kafka.group_id}-{tp.topic}-{tp.partition}"

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        """Start each partition's producer, then read the committed offsets and seek to
        them; only then may the partitions commit.

        The order is the fencing: initialising the id completes or aborts the previous
        owner's open transaction, so the offset read afterwards is final. A partition
        whose producer started first must not commit before that read either: records
        fetched meanwhile would be done and committed, the read would find this member's
        own commit, take it for a previous owner's, and seek back to it, so that records
        still staged were fetched and staged a second time (a fresh worker with a backlog
        stopped on "staged twice", exit 3).
        """
        added = []
        for tp in sorted(partitions):
            if tp in self._partitions:
                continue
            producer = PartitionProducer(
                tp, self.transactional_id(tp), self._producer, self._settings.kafka.group_id
            )
            part = _Partition(producer)
            self._partitions[tp] = part
            self._notify()
            if await self._restart(tp, part, ready=False):
                added.append(part)
        await self._seek_committed(partitions)
        for part in added:
            part.ready.set()

    async def _restart(self, tp: TopicPartition, part: _Partition, *, ready: bool = True) -> bool:
        """A fresh producer for the partition (ready at once with ``ready``); False if it
        cannot start (the partition is dropped and the worker stops)."""
        try:
            await part.producer.replace()
        except ProducerStartFailed as error:
            # A rebalance callback cannot raise (aiokafka drops it): stop the worker instead.
            log.error("exactly_once_partition_unusable", partition=str(tp), error=str(error))
            self._drop(tp, part, str(error))
            self.fail(error)
            return False
        if ready:
            part.ready.set()
        return True

    async def _seek_committed(self, partitions: set[TopicPartition]) -> None:
        ours = [tp for tp in partitions if tp in self._partitions]
        if not ours:
            return
        committed = await self._edge.fetch_committed(ours)
        for tp in ours:
            meta = committed.get(tp)
            if meta is None or meta.offset < 0:
                continue  # no commit yet: the consumer's offset reset applies
            state = self.offsets.get(tp)
            if state is not None:
                if state.start == meta.offset:
                    continue  # fetching already started from the final offset
                # Fetched from an offset read before the previous owner's transaction
                # ended: what was dispatched from there is stale.
                self.offsets.revoke(tp)
                self._notify()
            self._edge.seek(tp, meta.offset)

    async def revoked(self, partitions: set[TopicPartition]) -> None:
        await self.commit(only=partitions)
        for tp in partitions:
            part = self._partitions.get(tp)
            if part is not None:
                async with part.producer.lock:
                    await part.producer.stop()
                self._drop(tp, part, "revoked")
        self.forget(partitions)
        self._notify()

    def _drop(self, tp: TopicPartition, part: _Partition, why: str) -> None:
        """Forget the partition: waiters see it gone, staged outcomes are redone elsewhere."""
        if self._partitions.get(tp) is part:
            del self._partitions[tp]
            generation = self.offsets.generation(tp)
            if generation is not None:
                self._released[tp] = (generation, why)
        part.ready.set()
        for staged in part.staged.values():
            if not staged.committed.done():
                staged.committed.set_exception(PartitionRevoked(f"{tp}: {why}"))
        part.staged.clear()
        self._notify()
        log.info("exactly_once_partition_released", partition=str(tp), reason=why)

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        partitions = set(partitions)
        super().forget(partitions)
        for tp in partitions:
            self._released.pop(tp, None)

    async def close(self) -> None:
        for tp, part in list(self._partitions.items()):
            async with part.producer.lock:
                await part.producer.stop()
            self._drop(tp, part, "closing")
