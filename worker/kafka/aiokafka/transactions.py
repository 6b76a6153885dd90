"""Transactions on aiokafka: one transactional producer per input partition.

aiokafka cannot send the consumer's group metadata with the offsets (KIP-447), so a
partition's producer has a transactional id of its own, ``<prefix>-<group>-<topic>-
<partition>``: a new owner initialises it (the broker fences the old owner's producer
and ends its open transaction), and only then reads the committed offset and seeks to
it (``seeks_committed``).

Each step of a transaction maps aiokafka's failures to ``TransactionFailed`` (fenced
for ``ProducerFenced``); ``abandon`` aborts what it can and closes the producer, which
is never reused after a failure: aiokafka neither takes back a refused batch's sequence
numbers nor resets them on abort, so every later batch to that partition would be
refused (OutOfOrderSequenceNumber). A fresh producer with the same id starts clean.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    ProducerFenced,
    TransactionalIdAuthorizationFailed,
)
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from worker.kafka.aiokafka import clients
from worker.kafka.aiokafka._compat import in_transaction
from worker.kafka.aiokafka.producer import _PARTITIONER, _Batch, _Outbox
from worker.kafka.transactions import (
    START_ATTEMPTS,
    START_BACKOFF,
    Message,
    ProducerStartFailed,
    TransactionFailed,
)
from worker.settings import KafkaSettings

__all__ = [
    "PartitionProducer",
    "PerPartitionTransactions",
    "ProducerFactory",
    "transactional_producer",
]

log = structlog.get_logger(__name__)

#: Makes a partition's transactional producer (not started) for a transactional id.
ProducerFactory = Callable[[str], AIOKafkaProducer]

#: aiokafka's failures inside a transaction (AssertionError: its transaction state machine
#: after a fatal error).
_FAILURES = (KafkaError, AssertionError, OSError)


class PartitionProducer:
    """The transactional producer of one input partition."""

    #: Its batches (aiokafka's default 16 KiB) hold several small records: the broker's
    #: refusal of one batch names every record in it.
    exact_refusals = False

    def __init__(
        self,
        tp: TopicPartition,
        transactional_id: str,
        factory: ProducerFactory,
        group_id: str,
    ) -> None:
        self.tp = tp
        self.transactional_id = transactional_id
        self._factory = factory
        self._group_id = group_id
        self._producer: AIOKafkaProducer | None = None
        self.lock = asyncio.Lock()

    @property
    def running(self) -> bool:
        return self._producer is not None

    async def start(self, still_ours: Callable[[], bool] = lambda: True) -> bool:
        """Start (initialising the id fences any previous owner); retry a broker out of
        reach while the partition is ``still_ours()``, checked before every try: a member
        that lost the partition must never initialise its id again (it would fence the
        new owner)."""
        for attempt in range(1, START_ATTEMPTS + 1):
            if not still_ours():
                return False
            producer = self._factory(self.transactional_id)
            try:
                await producer.start()
            except TransactionalIdAuthorizationFailed as exc:
                await _stop_quietly(producer)
                raise ProducerStartFailed(
                    f"exactly_once: the broker refuses transactional id "
                    f"{self.transactional_id!r} for partition {self.tp}: {exc}; grant "
                    "Write and Describe on the transactional ids (WORKER_TRANSACTIONAL_ID_PREFIX*)"
                ) from exc
            except (KafkaError, OSError) as exc:
                await _stop_quietly(producer)
                log.warning(
                    "transactional_producer_start_failed",
                    partition=str(self.tp),
                    attempt=attempt,
                    error=f"{type(exc).__name__}: {exc}",
                )
                if attempt == START_ATTEMPTS:
                    raise ProducerStartFailed(
                        f"exactly_once: the transactional producer of partition {self.tp} did "
                        f"not start after {attempt} tries: {type(exc).__name__}: {exc}"
                    ) from exc
                await asyncio.sleep(START_BACKOFF.delay_s(attempt))
                continue
            self._producer = producer
            return True
        raise AssertionError("unreachable")  # pragma: no cover

    def _started(self) -> AIOKafkaProducer:
        if self._producer is None:
            raise TransactionFailed("the producer is closed")
        return self._producer

    async def begin(self) -> None:
        try:
            await self._started().begin_transaction()
        except _FAILURES as exc:
            raise _failed(exc) from exc

    async def send(self, messages: Sequence[Message], *, one_by_one: bool) -> tuple[int, ...]:
        """Every message sent, then every acknowledgement awaited: aiokafka's commit does not
        wait for batches still queued. A message over the producer's own size limit is
        refused by ``send`` itself, before anything is queued: a refusal like the broker's.
        ``one_by_one``: each message once the previous one is acknowledged (a batch of its
        own), stopping at the first refusal, which is then exact."""
        producer = self._started()
        try:
            if one_by_one:
                outcomes = await _each_alone(producer, messages)
            else:
                outcomes = await _all(producer, messages)
        except _FAILURES as exc:
            raise _failed(exc) from exc
        refused = tuple(
            i for i, r in enumerate(outcomes) if isinstance(r, MessageSizeTooLargeError)
        )
        failed = next((r for r in outcomes if isinstance(r, BaseException)), None)
        if failed is not None and not refused:
            raise _failed(failed)
        return refused

    async def send_offsets(self, offsets: Mapping[TopicPartition, int]) -> None:
        # aiokafka sends no group generation: fencing is by transactional id alone.
        positions = {tp: OffsetAndMetadata(offset, "") for tp, offset in offsets.items()}
        try:
            await self._started().send_offsets_to_transaction(positions, self._group_id)
        except _FAILURES as exc:
            raise _failed(exc) from exc

    async def commit(self) -> None:
        try:
            await self._started().commit_transaction()
        except _FAILURES as exc:
            raise _failed(exc) from exc

    async def abandon(self, why: str) -> None:
        """Abort if possible (readers move on at once), then close the producer."""
        log.warning("transaction_failed", partition=str(self.tp), error=why)
        producer = self._producer
        if producer is None:
            return
        with contextlib.suppress(*_FAILURES):
            if in_transaction(producer):
                await producer.abort_transaction()
        await self.stop()

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await _stop_quietly(producer)


async def _all(producer: AIOKafkaProducer, messages: Sequence[Message]) -> list[Any]:
    """Each message's acknowledgement or error: the messages appended to one batch per
    partition (another when one fills; the idempotent producer's outboxes, with one writer
    here), every batch handed over, then their acknowledgements awaited, one per batch and
    none per message. A message over the producer's own limit fits no batch, even alone:
    refused like one the broker refused."""
    outcomes: list[Any] = [None] * len(messages)
    landed: list[_Batch | None] = [None] * len(messages)
    boxes: dict[tuple[str, int], _Outbox] = {}
    known: dict[str, list[int]] = {}
    for i, (topic, value, key, headers) in enumerate(messages):
        partitions = known.get(topic)
        if partitions is None:
            partitions = known[topic] = sorted(await producer.partitions_for(topic))
        partition = _PARTITIONER(key, partitions, partitions)
        box = boxes.get((topic, partition))
        if box is None:
            box = boxes[(topic, partition)] = _Outbox(topic, partition)
        landed[i] = box.append(producer, key, value, headers)
        if landed[i] is None:
            outcomes[i] = MessageSizeTooLargeError("larger than the producer's limit")
    batches = [(box, batch) for box in boxes.values() for batch in box.batches]
    acks = []
    for box, batch in batches:
        batch.builder.close()
        acks.append(await producer.send_batch(batch.builder, box.topic, partition=box.partition))
    outcome_of = dict(
        zip(
            (batch for _, batch in batches),
            await asyncio.gather(*acks, return_exceptions=True),
            strict=True,
        )
    )
    for i, went in enumerate(landed):
        if went is not None:
            outcomes[i] = outcome_of[went]
    return outcomes


async def _each_alone(producer: AIOKafkaProducer, messages: Sequence[Message]) -> list[Any]:
    """Each message alone in its batch, until the first one refused."""
    outcomes: list[Any] = []
    for topic, value, key, headers in messages:
        try:
            future = await producer.send(topic, value=value, key=key, headers=list(headers))
            outcomes.append(await future)
        except MessageSizeTooLargeError as exc:
            outcomes.append(exc)
            break
    return outcomes


def _failed(exc: BaseException) -> TransactionFailed:
    fenced = isinstance(exc, ProducerFenced)
    if fenced:
        log.warning("transactional_producer_fenced", by="a new owner's producer")
    return TransactionFailed(f"{type(exc).__name__}: {exc}", fenced=fenced)


async def _stop_quietly(producer: AIOKafkaProducer) -> None:
    with contextlib.suppress(*_FAILURES):
        await producer.stop()


class PerPartitionTransactions:
    """aiokafka's ``Transactions``: a producer per input partition, fenced by its id."""

    seeks_committed = True
    shared = False
    start_fences = True

    def __init__(self, group_id: str, prefix: str, new_producer: ProducerFactory) -> None:
        """``new_producer``: makes a producer (not started) for a transactional id."""
        self._group_id = group_id
        self._prefix = prefix
        self._new_producer = new_producer

    def transactional_id(self, tp: TopicPartition) -> str:
        """Stable per group and input partition, so that a new owner fences the old one."""
        return f"{self._prefix}-{self._group_id}-{tp.topic}-{tp.partition}"

    def producer_for(self, tp: TopicPartition) -> PartitionProducer:
        return PartitionProducer(tp, self.transactional_id(tp), self._new_producer, self._group_id)


def transactional_producer(
    kafka: KafkaSettings,
    transactional_id: str,
    *,
    client_kwargs: Mapping[str, Any],
    max_request_bytes: int,
) -> AIOKafkaProducer:
    """A partition's transactional producer, not started; its client id names the partition."""
    return clients.producer(
        kafka,
        client_kwargs,
        suffix=transactional_id.rsplit("-", 2)[-2],
        transactional_id=transactional_id,
        **clients.idempotent(max_request_bytes, batched=False),
    )
