"""One input partition's transactional producer on aiokafka, never left half-handled.

Started, used for one transaction at a time, replaced after a failure. Every path through
``run_transaction`` ends in a commit, an abort, or the producer closed (and, when the
partition is still ours, re-created: initialising the same transactional id aborts
whatever the old producer left open). A fenced producer is never re-created: another
member owns the partition now.
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
from worker.kafka.transactions import (
    START_ATTEMPTS,
    START_BACKOFF,
    Message,
    ProducerStartFailed,
    TransactionOutcome,
)
from worker.settings import KafkaSettings

__all__ = ["PartitionProducer", "ProducerFactory", "transactional_producer"]

log = structlog.get_logger(__name__)

#: Makes a partition's transactional producer (not started) for a transactional id.
ProducerFactory = Callable[[str], AIOKafkaProducer]


class PartitionProducer:
    """The transactional producer of one input partition."""

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
        #: Held by a transaction and by stop(), so a producer never stops mid-transaction.
        self.lock = asyncio.Lock()

    async def start(self) -> None:
        """Start (initialising the id fences any previous owner); retry a broker out of reach.

        Raises ProducerStartFailed at once when the broker refuses the transactional id
        (an ACL), and after ``START_ATTEMPTS`` tries otherwise.
        """
        for attempt in range(1, START_ATTEMPTS + 1):
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
            return

    @property
    def running(self) -> bool:
        return self._producer is not None

    async def run_transaction(
        self, messages: Sequence[Message], point: int, metadata: str = ""
    ) -> TransactionOutcome:
        """Write ``messages`` and commit the consumer offset ``point`` in one transaction.

        The caller holds ``lock``. On a refusal for size the transaction is aborted
        and the refused messages are named, so the caller can replace them and try
        again. On any other failure the producer is replaced (or, when fenced, dropped).
        """
        producer = self._producer
        if producer is None:
            return TransactionOutcome(committed=False)
        try:
            await producer.begin_transaction()
            futures = [
                await producer.send(topic, value=value, key=key, headers=list(headers))
                for topic, value, key, headers in messages
            ]
            # Every message must be acknowledged inside the transaction before it
            # commits: aiokafka's commit does not wait for batches still queued.
            results = await asyncio.gather(*futures, return_exceptions=True)
            too_large = tuple(
                i for i, r in enumerate(results) if isinstance(r, MessageSizeTooLargeError)
            )
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                if too_large:
                    await self._abandon(f"refused for size: {len(too_large)} record(s)")
                    return TransactionOutcome(committed=False, too_large=too_large)
                raise failed
            await producer.send_offsets_to_transaction(
                {self.tp: OffsetAndMetadata(point, metadata)}, self._group_id
            )
            await producer.commit_transaction()
        except ProducerFenced:
            log.warning("transactional_producer_fenced", partition=str(self.tp))
            await self.stop()
            return TransactionOutcome(committed=False, fenced=True)
        except (KafkaError, AssertionError, OSError) as exc:
            # AssertionError: aiokafka's transaction state machine after a fatal error.
            await self._abandon(f"{type(exc).__name__}: {exc}")
            return TransactionOutcome(committed=False)
        return TransactionOutcome(committed=True)

    async def _abandon(self, why: str) -> None:
        """Abort if possible (readers move on at once), then close the producer: the next
        transaction starts a fresh one."""
        log.warning("transaction_failed", partition=str(self.tp), error=why)
        producer = self._producer
        if producer is None:
            return
        with contextlib.suppress(KafkaError, AssertionError, OSError):
            if in_transaction(producer):
                await producer.abort_transaction()
        # Even after a clean abort the producer is not reusable: aiokafka neither takes
        # back a refused batch's sequence numbers nor resets them on abort, so every later
        # batch to that partition would be refused (OutOfOrderSequenceNumber). A new
        # producer with the same id starts clean.
        await self.stop()

    async def replace(self) -> None:
        """Start a producer if there is none (the caller knows the partition is still ours)."""
        if self._producer is None:
            await self.start()

    async def stop(self) -> None:
        """Close the producer (pending transaction aborted by the broker later). Idempotent."""
        producer, self._producer = self._producer, None
        if producer is not None:
            await _stop_quietly(producer)


async def _stop_quietly(producer: AIOKafkaProducer) -> None:
    with contextlib.suppress(KafkaError, AssertionError, OSError):
        await producer.stop()


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
