"""The few private parts of aiokafka the worker relies on, each in one function."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from aiokafka.consumer import fetcher

from worker.kafka.aiokafka.records import TolerantRecords

__all__ = [
    "fail_unsent",
    "fetch_committed",
    "in_transaction",
    "read_header_keys_tolerantly",
    "rebalancing",
    "send_to_some_broker",
]


def read_header_keys_tolerantly() -> None:
    """aiokafka's fetcher reads every fetched partition through ``TolerantRecords``: a
    header key that is not UTF-8 no longer fails the fetch (see ``records``). It names
    the class it builds at each fetch, so replacing that name is enough; idempotent."""
    fetcher.MemoryRecords = TolerantRecords


def in_transaction(producer: Any) -> bool:
    """True while a transactional producer has a transaction open (aiokafka has no public
    way to ask, and ``abort_transaction`` outside one raises)."""
    manager = producer._txn_manager
    return manager is not None and bool(manager.is_in_transaction())


async def fetch_committed(consumer: Any, partitions: list[Any]) -> dict[Any, Any]:
    """Committed offsets with their metadata (``consumer.committed`` keeps only the offset)."""
    found: dict[Any, Any] = await consumer._coordinator.fetch_committed_offsets(partitions)
    return found


def rebalancing(consumer: Any) -> bool:
    """True when the consumer knows its group is rebalancing (its assignment may be stale)."""
    coordinator = consumer._coordinator
    # need_rejoin takes the Subscription (what the consumer follows), not the state holder.
    subscription = consumer._subscription.subscription
    return (
        coordinator is None or subscription is None or bool(coordinator.need_rejoin(subscription))
    )


def send_to_some_broker(client_owner: Any, request: Any) -> Awaitable[Any]:
    """Send one protocol request through a started consumer's (or admin's) client to any
    broker: neither has a public call for a request of one's own."""
    client = client_owner._client
    return client.send(client.get_random_node(), request)  # type: ignore[no-any-return]


def fail_unsent(producer: Any, error: BaseException) -> int:
    """Fail with ``error`` every batch a stopped producer still holds; returns how many.

    ``stop()`` flushes only the batches queued when it began and then cancels the sender:
    a batch appended meanwhile, or one whose send was cut short, is never sent, and its
    futures (the records' acks, and the drain that a send waiting for room awaits, for up
    to the request timeout) are never resolved.
    """
    accumulator = producer._message_accumulator
    batches = [b for queue in accumulator._batches.values() for b in queue]
    batches += list(accumulator._pending_batches)
    for batch in batches:
        batch.failure(exception=error)
        # Whoever awaits them gets the error; those nobody awaits must not be reported
        # as errors never retrieved.
        futures = [batch.future, batch._drain_waiter, *(f for f, _ in batch._msg_futures)]
        for future in futures:
            if future.done() and not future.cancelled():
                future.exception()
    return len(batches)
