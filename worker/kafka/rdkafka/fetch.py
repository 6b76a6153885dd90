"""One fetch of the librdkafka consumer: what it holds at once, else the first record to come.

librdkafka's ``consume(n, timeout)`` waits for all ``n`` records or the whole timeout;
its ``poll(timeout)`` returns at the first record. Asked with a timeout while records
trickle in, ``consume`` would wait it out in every loop of the intake, and each record
with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from confluent_kafka.aio import AIOConsumer

__all__ = ["fetch"]


async def fetch(consumer: AIOConsumer, limit: int, timeout_s: float) -> list[Any]:
    """Up to ``limit`` records librdkafka holds, at once; when it holds none, the first to
    come within ``timeout_s`` and those that came with it (none after the timeout)."""
    messages: list[Any] = await consumer.consume(limit, 0)
    if messages or timeout_s <= 0:
        return messages
    first = await consumer.poll(timeout_s)
    if first is None:
        return []
    return [first, *(await consumer.consume(limit - 1, 0))] if limit > 1 else [first]
