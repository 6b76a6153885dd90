"""The publisher's producer on aiokafka: idempotent (``acks=all``), replaced after a refusal
for size, so that the partition it wrote to takes writes again.

aiokafka gives a batch its partition's next sequence numbers when it sends it, and does
not take them back when the broker refuses the batch: every later batch to that partition
would be refused with OutOfOrderSequenceNumber. The producer of such a refusal is replaced
by a fresh one (new producer id, sequences from 0); writes it left unsent fail with
ProducerClosed and are tried again on the new one (``replaced``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    ProducerClosed,
)
from aiokafka.partitioner import DefaultPartitioner

from worker.kafka.aiokafka._compat import fail_unsent
from worker.kafka.publisher import Headers
from worker.kafka.writes import Retirements, settle_acks

__all__ = ["AioProducer"]

log = structlog.get_logger(__name__)

_T = TypeVar("_T")
#: How ``send`` chooses a record's partition (murmur2 of the key, as the Java client does).
_PARTITIONER = DefaultPartitioner()


@dataclass(slots=True, eq=False)
class _Batch:
    """Records of one partition in one batch of the producer's (a ``BatchBuilder``)."""

    builder: Any
    #: Once handed over: the batch's acknowledgement, or why it could not be handed over.
    ack: asyncio.Future[Any] | BaseException | None = None
    #: The producer's generation that took it.
    generation: int = 0


@dataclass(slots=True, eq=False)
class _Outbox:
    """One partition's records not yet handed to the producer, in batches, oldest first.

    aiokafka takes one batch per partition into each produce request, and ``send_batch``
    waits until the partition's pending batch has gone out: results written group by
    group in batches of their own went one small batch per partition per request, and
    each group waited for the request before. Records appended while a batch waits go out
    together in the next one.
    """

    topic: str
    partition: int
    batches: deque[_Batch] = field(default_factory=deque)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def append(
        self, producer: AIOKafkaProducer, key: bytes | None, value: bytes | None, headers: Headers
    ) -> _Batch | None:
        """The batch the record went to (a new one when the newest is full or handed
        over), or None when it is over the producer's limit alone."""
        newest = self.batches[-1] if self.batches else None
        if newest is not None and (
            newest.builder.append(key=key, value=value, timestamp=None, headers=list(headers))
            is not None
        ):
            return newest
        batch = _Batch(producer.create_batch())
        if (
            batch.builder.append(key=key, value=value, timestamp=None, headers=list(headers))
            is None
        ):
            return None
        self.batches.append(batch)
        return batch


class AioProducer:
    """An idempotent aiokafka producer, renewed after a size refusal (``Producer``)."""

    def __init__(
        self, new_producer: Callable[[], AIOKafkaProducer], *, topics: Sequence[str]
    ) -> None:
        """``new_producer`` makes an idempotent producer, not started (``clients.producer``
        with ``clients.idempotent``: its request limit bounds one record, headers included);
        ``topics``: those it writes to, known to a fresh producer before it takes writes."""
        self._topics = tuple(topics)
        self._new_producer = new_producer
        self._producer = new_producer()
        # Bumped each time the producer is replaced (see _renew_producer).
        self._generation = 0
        self._renewing = asyncio.Lock()
        # Which producers were stopped: their sends still pending are never acknowledged.
        self._retired = Retirements()
        # Per partition written by ``send_together``: bounded by the topics' partitions.
        self._outboxes: dict[tuple[str, int], _Outbox] = {}

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        """Flush what is pending and close. Idempotent."""
        await self._producer.stop()

    async def _renew_producer(self, generation: int, reason: BaseException) -> None:
        """Replace the producer of ``generation`` by a fresh one (new producer id), once.

        The old one is flushed and closed: its pending batches land, or fail and are
        retried by their writers on the new one.
        """
        async with self._renewing:
            if generation != self._generation:
                return  # another writer already replaced it
            old = self._producer
            fresh = self._new_producer()
            try:
                await fresh.start()
                # Known before it takes writes: a send waiting for a topic's metadata on
                # a producer stopped meanwhile (another refusal) would wait for ever.
                for topic in self._topics:
                    await fresh.partitions_for(topic)
            except BaseException:
                await fresh.stop()
                raise
            self._producer, self._generation = fresh, generation + 1
        log.warning("producer_renewed", reason=f"{type(reason).__name__}: {reason}")
        try:
            await old.stop()
        finally:
            # What it left unsent fails, so that its writers try again on the new producer.
            fail_unsent(old, ProducerClosed())
            self._retired.retire(generation)

    async def _acked(self, generation: int, sent: Awaitable[_T]) -> _T:
        """The broker's ack of a record sent by the producer of ``generation``.

        A size refusal or a sequence gap leaves that producer unable to write to
        the partition again: it is renewed before the error propagates.
        """
        try:
            return await self._retired.ack(generation, sent)
        except (MessageSizeTooLargeError, OutOfOrderSequenceNumber) as exc:
            await self._renew_producer(generation, exc)
            raise

    async def write(
        self, topic: str, value: bytes | None, key: bytes | None, headers: Headers
    ) -> Any:
        generation, producer = self._generation, self._producer
        # A record over the producer's own limit is refused here, before it is sent.
        sent = await producer.send(topic, value=value, key=key, headers=list(headers))
        return await self._acked(generation, sent)

    async def write_alone(
        self, topic: str, value: bytes | None, key: bytes | None, headers: Headers
    ) -> Any:
        generation, producer = self._generation, self._producer
        batch = producer.create_batch()
        if batch.append(key=key, value=value, timestamp=None, headers=list(headers)) is None:
            raise MessageSizeTooLargeError("larger than the producer's request limit")
        batch.close()
        partitions = sorted(await producer.partitions_for(topic))
        partition = DefaultPartitioner()(key, partitions, partitions)
        sent = await producer.send_batch(batch, topic, partition=partition)
        return await self._acked(generation, sent)

    def replaced(self, exc: KafkaError) -> bool:
        """The write failed because its producer was replaced (another record's size refusal
        broke its sequence numbers, or it was closed with the write unsent)."""
        return isinstance(exc, OutOfOrderSequenceNumber | ProducerClosed)

    async def send_in_order(
        self, topic: str, key: bytes | None, results: Sequence[tuple[bytes, Headers]]
    ) -> int:
        generation, producer, sent = self._generation, self._producer, []
        with contextlib.suppress(KafkaError):
            for value, headers in results:
                sent.append(await producer.send(topic, value=value, key=key, headers=list(headers)))
        acks = await asyncio.gather(
            *(self._acked(generation, future) for future in sent), return_exceptions=True
        )
        return next((i for i, ack in enumerate(acks) if isinstance(ack, BaseException)), len(sent))

    async def send_together(
        self,
        topic: str,
        records: Sequence[tuple[bytes | None, bytes, Headers]],
        enqueued: Callable[[], None] | None = None,
    ) -> list[BaseException | None]:
        """The records appended to their partitions' outboxes (the default partitioner's
        partition, as ``send`` chooses), then handed over with whatever other writers
        appended meanwhile: one acknowledgement per batch, none per record. A batch refused
        takes its records' refusal with it (each is then written alone); one record over
        the producer's own limit is refused alone."""
        try:
            partitions = sorted(await self._producer.partitions_for(topic))
        except Exception as exc:  # the producer's state: every record tries again alone
            return [exc] * len(records)
        outcomes: list[BaseException | None] = [None] * len(records)
        landed: list[_Batch | None] = [None] * len(records)
        last: dict[int, _Batch] = {}  # per partition, the last batch a record went to
        outboxes = self._outboxes
        for i, (key, value, headers) in enumerate(records):
            partition = _PARTITIONER(key, partitions, partitions)
            box = outboxes.get((topic, partition))
            if box is None:
                box = outboxes[(topic, partition)] = _Outbox(topic, partition)
            batch = box.append(self._producer, key, value, headers)
            if batch is None:
                outcomes[i] = MessageSizeTooLargeError("larger than the producer's limit")
                continue
            landed[i] = last[partition] = batch
        for partition, batch in last.items():
            await self._hand_over(outboxes[(topic, partition)], batch)
        if enqueued is not None:
            enqueued()
        batches = list(dict.fromkeys(b for b in landed if b is not None))
        settled = await settle_acks([b.ack or ProducerClosed() for b in batches])
        outcome_of = dict(zip(batches, settled, strict=True))
        refused: tuple[int, BaseException] | None = None
        for i, landed_in in enumerate(landed):
            if landed_in is not None:
                outcomes[i] = outcome = outcome_of[landed_in]
                if isinstance(outcome, MessageSizeTooLargeError | OutOfOrderSequenceNumber):
                    refused = (landed_in.generation, outcome)
        if refused is not None:
            # As in _acked: this producer cannot write to that partition again.
            await self._renew_producer(*refused)
        return outcomes

    async def _hand_over(self, box: _Outbox, until: _Batch) -> None:
        """Hand ``box``'s batches to the producer, oldest first, until ``until`` has been
        (by this writer or another). One writer at a time per partition: while it waits
        for the partition's pending batch to go out, the others append to the next one."""
        async with box.lock:
            while until.ack is None and box.batches:
                batch = box.batches.popleft()
                batch.builder.close()
                batch.generation = self._generation
                try:
                    batch.ack = await self._producer.send_batch(
                        batch.builder, box.topic, partition=box.partition
                    )
                except Exception as exc:
                    batch.ack = exc
                except BaseException:
                    # Cancelled (a forced stop): the records are not written; their writers
                    # are stopped too, or try again.
                    batch.ack = ProducerClosed()
                    raise

    async def send_audit(self, topic: str, value: bytes, key: bytes | None) -> Any:
        sent = await self._producer.send(topic, value=value, key=key)
        return await sent
