"""``exactly_once`` delivery: outcomes and offsets of an input partition in one Kafka transaction.

Each assigned input partition gets its own transactional producer whose
transactional id names the group and the partition. aiokafka has no
group-metadata fencing (KIP-447), so fencing relies on that id: when a
partition moves to another member, the new owner's producer initialises the
same id and the broker fences the old one, whose open transaction is aborted.

Outcomes are staged as records finish; every commit interval the contiguous
done prefix of each partition is written, with the next offset to consume, in
one transaction. A record's ``deliver`` returns once its transaction commits,
so it holds its window slot until then: staged outcomes are bounded by the window.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition

from worker.delivery.base import CommitEdge, Sink, TrackingDelivery
from worker.delivery.offsets import OffsetTracker
from worker.errors import PartitionRevoked
from worker.kafka._compat import in_transaction
from worker.kafka.publisher import Headers, dead_letter_value, kafka_compression
from worker.observability import Metrics
from worker.settings import Settings

log = structlog.get_logger(__name__)


@dataclass
class _Staged:
    messages: list[tuple[str, bytes | None, bytes | None, Headers]]
    committed: asyncio.Future[None]


@dataclass
class _PartitionTxn:
    producer: AIOKafkaProducer
    staged: dict[int, _Staged] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class ExactlyOnce(TrackingDelivery):
    """The exactly_once mode: stage outcomes per partition, commit them with their offsets."""

    def __init__(
        self,
        settings: Settings,
        offsets: OffsetTracker,
        edge: CommitEdge,
        metrics: Metrics,
        *,
        client_kwargs: Mapping[str, Any],
        max_request_bytes: int,
    ) -> None:
        super().__init__(offsets, edge, metrics, settings.kafka.commit_interval_ms / 1000)
        self._settings = settings
        self._offsets = offsets
        self._client_kwargs = dict(client_kwargs)
        self._max_request_bytes = max_request_bytes
        self._partitions: dict[TopicPartition, _PartitionTxn] = {}
        # Resolved once a partition's producer is ready (or the partition is gone):
        # records can be fetched before the assignment callback has finished.
        self._ready: dict[TopicPartition, asyncio.Future[None]] = {}

    @property
    def sink(self) -> Sink:
        return self

    async def complete(
        self,
        record: ConsumerRecord[bytes, bytes],
        ticket: int,
        deliver: Callable[[], Awaitable[None]],
    ) -> None:
        tp = TopicPartition(record.topic, record.partition)
        await self.ready(tp)
        if self._offsets.done(tp, record.offset, ticket):
            # Done when staged (deliver stages it before its first pause); deliver
            # returns once the transaction carrying the outcome and the offset committed.
            await deliver()

    async def commit(self, only: Iterable[TopicPartition] | None = None) -> None:
        """exactly_once: offsets are committed inside each partition's transaction."""
        await self.flush(set(only) if only is not None else None)

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        for tp in partitions:
            await self.assign(tp)

    async def revoked(self, partitions: set[TopicPartition]) -> None:
        await self.flush(partitions)
        for tp in partitions:
            await self.revoke(tp)
        self.forget(partitions)

    def transactional_id(self, tp: TopicPartition) -> str:
        """Stable per group and input partition, so a new owner fences the old one."""
        s = self._settings
        return f"{s.delivery.transactional_id_prefix}-{s.kafka.group_id}-{tp.topic}-{tp.partition}"

    async def assign(self, tp: TopicPartition) -> None:
        """Start the partition's producer; initialising its id fences any previous owner."""
        if tp in self._partitions:
            return
        producer = AIOKafkaProducer(
            bootstrap_servers=self._settings.kafka.bootstrap_servers,
            client_id=f"{self._settings.kafka.client_id}-{tp.topic}-{tp.partition}",
            transactional_id=self.transactional_id(tp),
            acks="all",
            enable_idempotence=True,
            linger_ms=self._settings.kafka.linger_ms,
            max_request_size=self._max_request_bytes,
            compression_type=kafka_compression(self._settings.kafka.compression_type),
            **self._client_kwargs,
        )
        await producer.start()
        self._partitions[tp] = _PartitionTxn(producer)
        self._ready_future(tp).set_result(None)

    def _ready_future(self, tp: TopicPartition) -> asyncio.Future[None]:
        if tp not in self._ready:
            self._ready[tp] = asyncio.get_running_loop().create_future()
        return self._ready[tp]

    async def ready(self, tp: TopicPartition) -> None:
        """Wait until the partition's producer is ready; PartitionRevoked if it went away.

        A record must only be marked done once this returned: staging it then
        happens without a pause, so no commit can cover a record not staged.
        """
        await asyncio.shield(self._ready_future(tp))
        if tp not in self._partitions:
            raise PartitionRevoked(str(tp))

    async def revoke(self, tp: TopicPartition) -> None:
        """Stop the producer; records still staged are redone by the next owner."""
        state = self._partitions.pop(tp, None)
        waiting = self._ready.pop(tp, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(None)  # waiters see the partition gone
        if state is None:
            return
        for staged in state.staged.values():
            if not staged.committed.done():
                staged.committed.set_exception(PartitionRevoked(str(tp)))
        await state.producer.stop()

    async def close(self) -> None:
        for tp in list(self._partitions):
            await self.revoke(tp)

    # -- the sink interface -------------------------------------------------------

    async def publish_result(
        self, record: ConsumerRecord[bytes, bytes], value: bytes, headers: Headers
    ) -> None:
        await self._stage(record, (self._settings.topics.output_topic, value, record.key, headers))

    async def publish_results(
        self, record: ConsumerRecord[bytes, bytes], results: Sequence[tuple[bytes, Headers]]
    ) -> None:
        topic = self._settings.topics.output_topic
        await self._stage_all(record, [(topic, v, record.key, h) for v, h in results])

    async def publish_dead_letter(
        self, record: ConsumerRecord[bytes, bytes], headers: Headers
    ) -> None:
        value = dead_letter_value(record.value, record.key)
        await self._stage(record, (self._settings.topics.dlq_topic, value, record.key, headers))

    async def _stage(
        self,
        record: ConsumerRecord[bytes, bytes],
        message: tuple[str, bytes | None, bytes | None, Headers],
    ) -> None:
        await self._stage_all(record, [message])

    async def _stage_all(
        self,
        record: ConsumerRecord[bytes, bytes],
        messages: list[tuple[str, bytes | None, bytes | None, Headers]],
    ) -> None:
        tp = TopicPartition(record.topic, record.partition)
        state = self._partitions.get(tp)
        if state is None:
            raise PartitionRevoked(str(tp))
        assert record.offset not in state.staged
        staged = _Staged(messages, asyncio.get_running_loop().create_future())
        state.staged[record.offset] = staged
        await staged.committed

    # -- commits --------------------------------------------------------------------

    async def flush(self, only: set[TopicPartition] | None = None) -> None:
        """Commit each partition's staged done prefix with its offset, one transaction each."""
        for tp, state in list(self._partitions.items()):
            if only is None or tp in only:
                await self._flush_partition(tp, state)

    async def _flush_partition(self, tp: TopicPartition, state: _PartitionTxn) -> None:
        async with state.lock:
            point = self._offsets.commit_point(tp)
            ready = sorted(o for o in state.staged if point is not None and o < point)
            if not ready:
                return
            assert point is not None
            producer = state.producer
            try:
                await producer.begin_transaction()
                sent = [
                    await producer.send(topic, value=value, key=key, headers=list(headers))
                    for offset in ready
                    for topic, value, key, headers in state.staged[offset].messages
                ]
                # Every message must be acknowledged inside the transaction before it
                # commits: aiokafka's commit does not wait for batches still queued.
                await asyncio.gather(*sent)
                await producer.send_offsets_to_transaction(
                    {tp: OffsetAndMetadata(point, "")}, self._settings.kafka.group_id
                )
                await producer.commit_transaction()
            except KafkaError as exc:
                log.warning("transaction_failed", partition=str(tp), error=repr(exc))
                self._metrics.commit_failures_total.inc()
                if in_transaction(producer):
                    await producer.abort_transaction()
                return  # staged outcomes stay; the next flush tries again
            for offset in ready:
                staged = state.staged.pop(offset)
                if not staged.committed.done():
                    staged.committed.set_result(None)
            self._offsets.mark_committed({tp: point})
            self._metrics.transactions_total.inc()
            self._metrics.commits_total.inc()
