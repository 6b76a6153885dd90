"""Results and dead letters to Kafka; a record counts as done only once the broker acks it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
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
from aiokafka.structs import ConsumerRecord

from worker import errors
from worker.kafka.aiokafka._compat import fail_unsent
from worker.kafka.writes import Retirements, settle_acks, write_with_retries

__all__ = [
    "DeadLetterWriteFailed",
    "Publisher",
    "ResultWriteFailed",
    "settle_acks",  # re-exported: the librdkafka publisher and the audit log use them
    "write_with_retries",
]

log = structlog.get_logger(__name__)

Headers = Sequence[tuple[str, bytes | None]]
_T = TypeVar("_T")

#: Producer batch per partition. aiokafka's 16 KiB default fills after ~40 results;
#: senders then queue behind the in-flight batch, which costs CPU per record.
_MAX_BATCH_BYTES = 512 * 1024


class DeadLetterWriteFailed(errors.WriteFailed):
    """A dead letter could not be written after every retry: the worker must stop."""


class ResultWriteFailed(errors.WriteFailed):
    """A result could not be written after every retry: the worker must stop."""


#: Room for headers (ours and the request's) on top of the largest value a producer sends.
PRODUCER_HEADROOM_BYTES = 64 * 1024

#: Headers of a dead letter whose value (or key) the dead-letter topic refused for its size.
X_VALUE_OMITTED = "x-value-omitted"
X_ORIGINAL_VALUE_BYTES = "x-original-value-bytes"
X_ORIGINAL_VALUE_SHA256 = "x-original-value-sha256"
X_KEY_OMITTED = "x-key-omitted"
X_ORIGINAL_KEY_BYTES = "x-original-key-bytes"
X_ORIGINAL_KEY_SHA256 = "x-original-key-sha256"


def kafka_compression(compression_type: str) -> str | None:
    """The producers' ``compression_type`` for the setting (``none`` is no compression)."""
    return None if compression_type == "none" else compression_type


def dead_letter_value(value: bytes | None, key: bytes | None) -> bytes | None:
    """The value a dead letter carries: the original, or empty when key and value are null.

    Kafka allows a record with neither key nor value; aiokafka refuses to send one.
    """
    return b"" if value is None and key is None else value


def omitted(
    headers: Headers, value: bytes | None, key: bytes | None, *, drop_key: bool
) -> tuple[bytes, bytes | None, list[tuple[str, bytes | None]]]:
    """A dead letter without its value (and key): sizes and digests in headers instead.

    The original stays findable through ``x-source-topic/partition/offset``.
    """
    added: list[tuple[str, bytes | None]] = [
        (X_VALUE_OMITTED, b"true"),
        (X_ORIGINAL_VALUE_BYTES, str(len(value or b"")).encode()),
        (X_ORIGINAL_VALUE_SHA256, hashlib.sha256(value or b"").hexdigest().encode()),
    ]
    if drop_key:
        added += [
            (X_KEY_OMITTED, b"true"),
            (X_ORIGINAL_KEY_BYTES, str(len(key or b"")).encode()),
            (X_ORIGINAL_KEY_SHA256, hashlib.sha256(key or b"").hexdigest().encode()),
        ]
    return b"", None if drop_key else key, [*headers, *added]


class Publisher:
    """An idempotent producer (``acks=all``) writing results and dead letters."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        output_topic: str,
        dlq_topic: str,
        client_id: str,
        linger_ms: int,
        max_request_bytes: int,
        client_kwargs: Mapping[str, Any],
        compression_type: str = "none",
        write_attempts: int = 5,
        on_value_omitted: Callable[[], None] | None = None,
    ) -> None:
        """``max_request_bytes`` bounds one record: the largest result or dead letter, headers
        included (see PRODUCER_HEADROOM_BYTES)."""
        self.output_topic = output_topic
        self.dlq_topic = dlq_topic
        self._write_attempts = write_attempts
        self._on_value_omitted = on_value_omitted
        self._producer_kwargs: dict[str, Any] = dict(
            bootstrap_servers=bootstrap_servers,
            client_id=client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=linger_ms,
            max_request_size=max_request_bytes,
            max_batch_size=min(_MAX_BATCH_BYTES, max_request_bytes),
            compression_type=kafka_compression(compression_type),
            **client_kwargs,
        )
        self._producer = AIOKafkaProducer(**self._producer_kwargs)
        # Bumped each time the producer is replaced (see _renew_producer).
        self._generation = 0
        self._renewing = asyncio.Lock()
        # Which producers were stopped: their sends still pending are never acknowledged.
        self._retired = Retirements()

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        """Flush what is pending and close. Idempotent."""
        await self._producer.stop()

    async def _renew_producer(self, generation: int, reason: BaseException) -> None:
        """Replace the producer of ``generation`` by a fresh one (new producer id), once.

        aiokafka gives a batch its partition's next sequence numbers when it sends
        it, and does not take them back when the broker refuses the batch for its
        size: every later batch to that partition is then refused with
        OutOfOrderSequenceNumber, forever. A fresh idempotent producer starts its
        sequences at 0. The old one is flushed and closed: its pending batches
        land, or fail and are retried by their writers on the new one.
        """
        async with self._renewing:
            if generation != self._generation:
                return  # another writer already replaced it
            old = self._producer
            fresh = AIOKafkaProducer(**self._producer_kwargs)
            try:
                await fresh.start()
                # Known before it takes writes: a send waiting for a topic's metadata on
                # a producer stopped meanwhile (another refusal) would wait for ever.
                for topic in (self.output_topic, self.dlq_topic):
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

    async def write_result(self, value: bytes, key: bytes | None, headers: Headers) -> Any:
        """Write a result and wait for the broker's ack.

        Raises OutputTooLarge when the broker (or the producer's own limit)
        refuses the record for its size; other Kafka errors propagate.
        """
        topic = self.output_topic
        try:
            return await self._send(topic, value, key, headers, ResultWriteFailed)
        except MessageSizeTooLargeError:
            pass
        # The broker refuses whole batches: an innocent result may have shared a
        # batch with a too-large one. Alone in a batch of its own, it is judged
        # on its own size.
        try:
            return await self._send_alone(topic, value, key, headers, ResultWriteFailed)
        except MessageSizeTooLargeError:
            keyed = f" with a {len(key)}-byte key" if key and len(key) > 1024 else ""
            raise errors.OutputTooLarge(
                f"result of {len(value)} bytes{keyed} is larger than {topic!r} accepts"
            ) from None

    async def _send_alone(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers: Headers,
        failure: type[errors.WriteFailed],
    ) -> Any:
        """Send one record in a batch of its own; MessageSizeTooLargeError if refused for size."""

        async def send_once() -> Any:
            generation, producer = self._generation, self._producer
            batch = producer.create_batch()
            if batch.append(key=key, value=value, timestamp=None, headers=list(headers)) is None:
                raise MessageSizeTooLargeError("larger than the producer's request limit")
            batch.close()
            partitions = sorted(await producer.partitions_for(topic))
            partition = DefaultPartitioner()(key, partitions, partitions)
            sent = await producer.send_batch(batch, topic, partition=partition)
            return await self._acked(generation, sent)

        return await write_with_retries(
            send_once,
            what=f"write to {topic!r}",
            attempts=self._write_attempts,
            failure=failure,
            collateral=_replaced,
        )

    # -- the at-least-once sink: straight to the broker, waiting for each ack ------

    async def publish_result(
        self, record: ConsumerRecord[bytes, bytes], value: bytes, headers: Headers
    ) -> None:
        await self.write_result(value, record.key, headers)

    async def publish_results(
        self, record: ConsumerRecord[bytes, bytes], results: Sequence[tuple[bytes, Headers]]
    ) -> None:
        """Several results of one record, in order: sent together, then acknowledged.

        One task appends them to the producer in order (same key, same partition),
        so they travel in order, mostly in one batch, for one ack. If any is not
        acknowledged, it and every later one are written again one by one, in
        order, with write_result's retries and size handling (a later one that
        had landed appears twice: at-least-once).
        """
        if len(results) == 1:
            await self.write_result(results[0][0], record.key, results[0][1])
            return
        generation, producer, sent = self._generation, self._producer, []
        with contextlib.suppress(KafkaError):
            for value, headers in results:
                sent.append(
                    await producer.send(
                        self.output_topic, value=value, key=record.key, headers=list(headers)
                    )
                )
        acks = await asyncio.gather(
            *(self._acked(generation, future) for future in sent), return_exceptions=True
        )
        failed = next(
            (i for i, ack in enumerate(acks) if isinstance(ack, BaseException)), len(sent)
        )
        for value, headers in results[failed:]:
            await self.write_result(value, record.key, headers)

    async def publish_many(
        self, results: Sequence[tuple[ConsumerRecord[bytes, bytes], bytes, Headers]]
    ) -> list[BaseException | None]:
        """Results of several records, handed to the producer together: every send
        enqueued, then every ack awaited. Per result: None once acknowledged, else the
        error that kept it out (not retried here: the caller writes it again with
        ``publish_result``, alone, with its retries and size handling)."""
        generation, producer, topic = self._generation, self._producer, self.output_topic
        sent: list[asyncio.Future[Any] | BaseException] = []
        for record, value, headers in results:
            try:
                sent.append(
                    await producer.send(topic, value=value, key=record.key, headers=list(headers))
                )
            except Exception as exc:  # refused before sending (its size), or the producer's state
                sent.append(exc)
        outcomes = await settle_acks(sent)
        refused = next(
            (
                o
                for o in outcomes
                if isinstance(o, MessageSizeTooLargeError | OutOfOrderSequenceNumber)
            ),
            None,
        )
        if refused is not None:
            # As in _acked: this producer cannot write to that partition again.
            await self._renew_producer(generation, refused)
        return outcomes

    async def publish_dead_letter(
        self, record: ConsumerRecord[bytes, bytes], headers: Headers
    ) -> None:
        await self.write_dead_letter(record.value, record.key, headers)

    async def send_audit(self, topic: str, value: bytes, key: bytes | None) -> Any:
        """Write an audit record and wait for the broker's ack."""
        sent = await self._producer.send(topic, value=value, key=key)
        return await sent

    async def write_dead_letter(
        self, value: bytes | None, key: bytes | None, headers: Headers
    ) -> Any:
        """Write a dead letter, retrying with backoff; DeadLetterWriteFailed if it never lands.

        A dead letter refused for its size is tried alone in a batch, then without
        its value, then without its key too (the dead-letter topic's
        ``max.message.bytes`` may be below the input topic's); only a topic that
        refuses even that stops the worker.
        """
        topic = self.dlq_topic
        value = dead_letter_value(value, key)
        try:
            return await self._send(topic, value, key, headers, DeadLetterWriteFailed)
        except MessageSizeTooLargeError:
            pass
        with contextlib.suppress(MessageSizeTooLargeError):
            return await self._send_alone(topic, value, key, headers, DeadLetterWriteFailed)
        for drop_key in (False, True):
            if drop_key and key is None:
                continue
            slim = omitted(headers, value, key, drop_key=drop_key)
            with contextlib.suppress(MessageSizeTooLargeError):
                sent = await self._send_alone(topic, *slim, DeadLetterWriteFailed)
                log.warning(
                    "dead_letter_value_omitted",
                    value_bytes=len(value or b""),
                    key_omitted=drop_key,
                    dlq_topic=topic,
                )
                if self._on_value_omitted is not None:
                    self._on_value_omitted()
                return sent
        raise DeadLetterWriteFailed(
            f"{topic!r} refuses the dead letter even without its value and key; "
            "raise the topic's max.message.bytes"
        )

    async def _send(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers: Headers,
        failure: type[errors.WriteFailed],
    ) -> Any:
        """Send and wait for the ack, with `write_with_retries`; ``failure`` if it never lands."""

        async def send_once() -> Any:
            generation, producer = self._generation, self._producer
            # A record over the producer's own limit is refused here, before it is sent.
            sent = await producer.send(topic, value=value, key=key, headers=list(headers))
            return await self._acked(generation, sent)

        return await write_with_retries(
            send_once,
            what=f"write to {topic!r}",
            attempts=self._write_attempts,
            failure=failure,
            collateral=_replaced,
        )


def _replaced(exc: KafkaError) -> bool:
    """The write failed because its producer was replaced (another record's size refusal
    broke its sequence numbers, or it was closed with the write unsent)."""
    return isinstance(exc, OutOfOrderSequenceNumber | ProducerClosed)
