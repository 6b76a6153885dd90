"""Results and dead letters to Kafka; a record counts as done only once the broker acks it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import ConsumerRecord

from worker import errors

log = structlog.get_logger(__name__)

Headers = Sequence[tuple[str, bytes]]
_T = TypeVar("_T")

#: Producer batch per partition. aiokafka's 16 KiB default fills after ~40 results;
#: senders then queue behind the in-flight batch, which costs CPU per record.
_MAX_BATCH_BYTES = 512 * 1024


class DeadLetterWriteFailed(errors.WriteFailed):
    """A dead letter could not be written after every retry: the worker must stop."""


class ResultWriteFailed(errors.WriteFailed):
    """A result could not be written after every retry: the worker must stop."""


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
        write_attempts: int = 5,
    ) -> None:
        self.output_topic = output_topic
        self.dlq_topic = dlq_topic
        self._write_attempts = write_attempts
        self._producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap_servers,
            client_id=client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=linger_ms,
            max_request_size=max_request_bytes,
            max_batch_size=min(_MAX_BATCH_BYTES, max_request_bytes),
            compression_type=None,
            **client_kwargs,
        )

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        """Flush what is pending and close. Idempotent."""
        await self._producer.stop()

    async def write_result(self, value: bytes, key: bytes | None, headers: Headers) -> Any:
        """Write a result and wait for the broker's ack.

        Raises OutputTooLarge when the broker (or the producer's own limit)
        refuses the record for its size; other Kafka errors propagate.
        """
        try:
            return await self._send(self.output_topic, value, key, headers, ResultWriteFailed)
        except MessageSizeTooLargeError:
            # The broker refuses whole batches: an innocent result may have shared a
            # batch with a too-large one. Alone in a batch of its own, it is judged
            # on its own size.
            return await self._write_alone(value, key, headers)

    async def _write_alone(self, value: bytes, key: bytes | None, headers: Headers) -> Any:
        batch = self._producer.create_batch()
        if batch.append(key=key, value=value, timestamp=None, headers=list(headers)) is None:
            raise errors.OutputTooLarge(
                f"result of {len(value)} bytes is larger than the producer's request limit"
            )
        batch.close()
        partitions = sorted(await self._producer.partitions_for(self.output_topic))
        partition = DefaultPartitioner()(key, partitions, partitions)
        try:
            sent = await self._producer.send_batch(batch, self.output_topic, partition=partition)
            return await sent
        except MessageSizeTooLargeError:
            raise errors.OutputTooLarge(
                f"result of {len(value)} bytes is larger than the output topic accepts"
            ) from None

    # -- the at-least-once sink: straight to the broker, waiting for each ack ------

    async def publish_result(
        self, record: ConsumerRecord[bytes, bytes], value: bytes, headers: Headers
    ) -> None:
        await self.write_result(value, record.key, headers)

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
        """Write a dead letter, retrying with backoff; DeadLetterWriteFailed if it never lands."""
        try:
            return await self._send(self.dlq_topic, value, key, headers, DeadLetterWriteFailed)
        except MessageSizeTooLargeError as exc:
            size = len(value or b"")
            raise DeadLetterWriteFailed(
                f"dead letter of {size} bytes is larger than {self.dlq_topic!r} accepts; "
                "raise the topic's max.message.bytes"
            ) from exc

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
            sent = await self._producer.send(topic, value=value, key=key, headers=list(headers))
            return await sent

        return await write_with_retries(
            send_once, what=f"write to {topic!r}", attempts=self._write_attempts, failure=failure
        )


async def write_with_retries(
    write: Callable[[], Awaitable[_T]],
    *,
    what: str,
    attempts: int,
    failure: type[errors.WriteFailed],
) -> _T:
    """Call ``write``, retrying Kafka errors (a broker restart, a leader moving) with
    backoff; raise ``failure`` when every try failed. A size refusal is not retried:
    MessageSizeTooLargeError propagates at once."""
    delay_s = 0.2
    for attempt in range(1, attempts + 1):
        try:
            return await write()
        except MessageSizeTooLargeError:
            raise
        except KafkaError as exc:
            log.warning(
                "write_failed", what=what, attempt=attempt, error=f"{type(exc).__name__}: {exc}"
            )
            if attempt == attempts:
                raise failure(
                    f"{what} failed {attempt} times: {type(exc).__name__}: {exc}"
                ) from exc
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 5.0)
    raise AssertionError("unreachable")
