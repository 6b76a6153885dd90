"""Results and dead letters to Kafka; a record counts as done only once the broker acks it.

``Publisher`` is the policy, on either client: retries, a result refused for its size
judged alone, a dead letter slimmed until the topic takes it. Under it a ``Producer`` of
the chosen client (``aiokafka/producer.py``, ``rdkafka/publisher.py``) writes the records.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import structlog
from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from aiokafka.structs import ConsumerRecord

from worker import errors
from worker.kafka.writes import write_with_retries
from worker.wire.headers import omitted_value_headers

__all__ = [
    "DeadLetterWriteFailed",
    "Producer",
    "Publisher",
    "ResultWriteFailed",
    "write_with_retries",  # re-exported: the audit log uses it
]

log = structlog.get_logger(__name__)

Headers = Sequence[tuple[str, bytes | None]]


class DeadLetterWriteFailed(errors.WriteFailed):
    """A dead letter could not be written after every retry: the worker must stop."""


class ResultWriteFailed(errors.WriteFailed):
    """A result could not be written after every retry: the worker must stop."""


#: Room for headers (ours and the request's) on top of the largest value a producer sends.
PRODUCER_HEADROOM_BYTES = 64 * 1024

#: The worker's producers' own limit on one record: librdkafka's highest
#: ``message.max.bytes``, so that no record is refused by the producer itself and the
#: broker judges each by its topic's ``max.message.bytes``. A dead letter carries its
#: request as it came, however far over WORKER_MAX_REQUEST_BYTES (TOO_LARGE), and loses
#: its value only when the dead-letter topic refuses it.
LARGEST_RECORD_BYTES = 1_000_000_000


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
    slim = omitted_value_headers(headers, value, key, drop_key=drop_key)
    return b"", None if drop_key else key, slim


class Producer(Protocol):
    """What the publisher asks of a client's idempotent producer (``acks=all``). A write is
    one try: Kafka errors propagate (aiokafka's classes, on either client), and
    MessageSizeTooLargeError when the record is refused for its size."""

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Flush what is pending and close. Idempotent."""
        ...

    async def write(
        self, topic: str, value: bytes | None, key: bytes | None, headers: Headers
    ) -> Any:
        """Send one record and wait for the broker's ack."""
        ...

    async def write_alone(
        self, topic: str, value: bytes | None, key: bytes | None, headers: Headers
    ) -> Any:
        """Send one record in a batch of its own (judged on its own size); wait for the ack."""
        ...

    def replaced(self, exc: KafkaError) -> bool:
        """True when a write failed only because its producer was replaced: it is tried
        again at once, without counting a try."""
        ...

    async def send_in_order(
        self, topic: str, key: bytes | None, results: Sequence[tuple[bytes, Headers]]
    ) -> int:
        """Send ``results`` (one record's, same key) together, in order, then await their
        acks; the index of the first not acknowledged (``len(results)`` when all were)."""
        ...

    async def send_together(
        self,
        topic: str,
        records: Sequence[tuple[bytes | None, bytes, Headers]],
        enqueued: Callable[[], None] | None = None,
    ) -> list[BaseException | None]:
        """Every (key, value, headers) sent (then ``enqueued()`` is called, unless the
        producer could not take them), then every ack awaited: per record None once
        acknowledged, else the error that kept it out (not retried)."""
        ...

    async def send_audit(self, topic: str, value: bytes, key: bytes | None) -> Any:
        """Write an audit record and wait for the broker's ack."""
        ...


class Publisher:
    """Results and dead letters, written by the chosen client's ``producer``."""

    def __init__(
        self,
        producer: Producer,
        *,
        output_topic: str,
        dlq_topic: str,
        write_attempts: int = 5,
        on_value_omitted: Callable[[], None] | None = None,
    ) -> None:
        self.producer = producer
        self.output_topic = output_topic
        self.dlq_topic = dlq_topic
        self._write_attempts = write_attempts
        self._on_value_omitted = on_value_omitted

    async def start(self) -> None:
        await self.producer.start()

    async def stop(self) -> None:
        """Flush what is pending and close. Idempotent."""
        await self.producer.stop()

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
        return await write_with_retries(
            lambda: self.producer.write_alone(topic, value, key, headers),
            what=f"write to {topic!r}",
            attempts=self._write_attempts,
            failure=failure,
            collateral=self.producer.replaced,
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

        They are appended to the producer in order (same key, same partition), so they
        travel in order, mostly in one batch, for one ack. If any is not acknowledged,
        it and every later one are written again one by one, in order, with
        write_result's retries and size handling (a later one that had landed appears
        twice: at-least-once).
        """
        if len(results) == 1:
            await self.write_result(results[0][0], record.key, results[0][1])
            return
        failed = await self.producer.send_in_order(self.output_topic, record.key, results)
        for value, headers in results[failed:]:
            await self.write_result(value, record.key, headers)

    async def publish_many(
        self,
        results: Sequence[tuple[ConsumerRecord[bytes, bytes], bytes, Headers]],
        *,
        enqueued: Callable[[], None] | None = None,
    ) -> list[BaseException | None]:
        """Results of several records, handed to the producer together: every send
        enqueued (then ``enqueued()`` is called), then every ack awaited. Per result: None
        once acknowledged, else the error that kept it out (not retried here: the caller
        writes it again with ``publish_result``, alone, with its retries and size
        handling)."""
        records = [(record.key, value, headers) for record, value, headers in results]
        return await self.producer.send_together(self.output_topic, records, enqueued)

    async def publish_dead_letter(
        self, record: ConsumerRecord[bytes, bytes], headers: Headers
    ) -> None:
        await self.write_dead_letter(record.value, record.key, headers)

    async def send_audit(self, topic: str, value: bytes, key: bytes | None) -> Any:
        """Write an audit record and wait for the broker's ack."""
        return await self.producer.send_audit(topic, value, key)

    async def send_audit_many(
        self, topic: str, records: Sequence[tuple[bytes | None, bytes, Headers]]
    ) -> list[BaseException | None]:
        """Write audit records together (one try each): per record None once acknowledged,
        else the error that kept it out."""
        return await self.producer.send_together(topic, records)

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
        return await write_with_retries(
            lambda: self.producer.write(topic, value, key, headers),
            what=f"write to {topic!r}",
            attempts=self._write_attempts,
            failure=failure,
            collateral=self.producer.replaced,
        )
