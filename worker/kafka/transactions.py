"""Kafka transactions as delivery's ``exactly_once`` speaks them, whatever the client.

A ``TransactionalProducer`` runs one transaction at a time in steps (begin, send, send
offsets, commit; abandon on any failure), so that the one ``exactly_once`` of
``worker.delivery`` checks between two steps that the partitions are still its own.
``Transactions`` says which producer carries a partition's outcomes: one per input
partition fenced by its transactional id (aiokafka, ``aiokafka/transactions.py``), or
one per worker fenced by the group generation (librdkafka, ``rdkafka/transactions.py``).
The Kafka edge builds the chosen client's; delivery imports no client module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from worker.errors import Fatal
from worker.flow.retry import Backoff
from worker.kafka.types import TopicPartition
from worker.wire import Headers

__all__ = [
    "START_ATTEMPTS",
    "START_BACKOFF",
    "Message",
    "ProducerStartFailed",
    "TransactionDeferred",
    "TransactionFailed",
    "TransactionalProducer",
    "Transactions",
]

#: Tries of starting a transactional producer before the worker gives up on it, on either
#: client: with the backoff, a broker out of reach for about a minute. Five tries (7.5 s)
#: were outlasted by a broker restart that began as a failed transaction's producer was
#: replaced (exit 3, chaos soak, exactly_once on aiokafka, seed 1222039730).
START_ATTEMPTS = 20
START_BACKOFF = Backoff(first_s=0.5, max_s=4.0)

#: (topic, value, key, headers) of one record a transaction writes.
Message = tuple[str, bytes | None, bytes | None, Headers]


class ProducerStartFailed(Fatal):
    """A transactional producer cannot start: its outcomes could never be written."""


class TransactionFailed(Exception):
    """A step of a transaction failed: the transaction is to be abandoned.

    ``fenced``: the broker says another member owns the partitions now (a new owner's
    producer, or the group coordinator refusing a stale generation): never tried again
    by this member.
    """

    def __init__(self, why: str, *, fenced: bool = False) -> None:
        super().__init__(why)
        self.fenced = fenced


class TransactionDeferred(Exception):
    """No transaction can begin now (a rebalance is under way); nothing was begun."""


class TransactionalProducer(Protocol):
    """One transactional producer: one transaction at a time, under ``lock``.

    Every path through a transaction ends in ``commit`` or in ``abandon``; after an
    abandon (or a failed start) the producer is not running, and ``start`` makes a fresh
    one with the same transactional id.
    """

    transactional_id: str
    #: Held through a whole transaction and by ``stop``.
    lock: asyncio.Lock

    @property
    def running(self) -> bool: ...

    @property
    def exact_refusals(self) -> bool:
        """True when a refusal for size names exactly the records refused (one record a
        batch); False when it names every record of the refused batch."""
        ...

    async def start(self, still_ours: Callable[[], bool]) -> bool:
        """Start (initialising the transactional id fences its previous producers),
        retrying a broker out of reach while ``still_ours()``; False when it stopped trying
        because the partitions are no longer ours. Raises ProducerStartFailed when the
        broker refuses the id, or after ``START_ATTEMPTS`` tries."""
        ...

    async def begin(self) -> None:
        """Begin a transaction; TransactionDeferred when it cannot begin now,
        TransactionFailed otherwise."""
        ...

    async def send(self, messages: Sequence[Message], *, one_by_one: bool) -> tuple[int, ...]:
        """Write the messages in the transaction and wait for every acknowledgement; the
        indexes of those refused for their size (the transaction must then be abandoned).
        ``one_by_one``: each message after the previous one's acknowledgement, stopping at
        the first refusal (exact even when refusals are not). TransactionFailed otherwise."""
        ...

    async def send_offsets(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Commit these next offsets of the consumer group with the transaction."""
        ...

    async def commit(self) -> None:
        """Commit the transaction (TransactionFailed: it did not commit)."""
        ...

    async def abandon(self, why: str) -> None:
        """Abort the transaction if possible, and close the producer."""
        ...

    async def stop(self) -> None:
        """Close the producer (an open transaction is aborted by the broker). Idempotent."""
        ...


class Transactions(Protocol):
    """The chosen client's transactional producers, and how a new owner starts."""

    @property
    def seeks_committed(self) -> bool:
        """True when a new owner reads the committed offsets itself, once its producer has
        fenced the previous owner's (aiokafka); False when the consumer starts from the
        stable committed offsets (librdkafka)."""
        ...

    @property
    def shared(self) -> bool:
        """True when one producer carries every partition (kept while the worker runs);
        False when each partition has its own (stopped when the partition goes)."""
        ...

    @property
    def start_fences(self) -> bool:
        """True when starting a producer fences whoever held its transactional id before
        (aiokafka's ids name a partition: its new owner's); False when each worker's id is
        its own (librdkafka: the group fences)."""
        ...

    def producer_for(self, tp: TopicPartition) -> TransactionalProducer:
        """The producer that carries ``tp``'s outcomes (made, not started)."""
        ...
