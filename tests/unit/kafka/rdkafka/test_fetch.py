"""The librdkafka intake's fetch: records go to the worker as soon as librdkafka has them.

The consumer is an in-memory fake of the two calls the fetch makes (``consume`` and
``poll`` of ``confluent_kafka.aio.AIOConsumer``), with librdkafka's documented waits:
``consume(n, timeout)`` waits until ``n`` records or the timeout, ``poll(timeout)``
until one record or the timeout. A real broker cannot be made to deliver records at
chosen moments inside one call; the intake against a real broker is in
tests/integration.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from worker.kafka.rdkafka.fetch import fetch

#: The fake's consume waits its whole timeout when short of records (as librdkafka's does).
LONG_S = 5.0


class Consumer:
    """Records queued locally now, and one more arriving ``arrives_s`` after the first call."""

    def __init__(self, queued: int, arrives_s: float | None = None) -> None:
        self.queued: deque[str] = deque(f"r{i}" for i in range(queued))
        self.arrives_s = arrives_s
        self.started = time.monotonic()
        self.calls: list[tuple[str, int, float]] = []

    def _arrived(self) -> None:
        late = self.arrives_s
        if late is not None and time.monotonic() - self.started >= late:
            self.queued.append("late")
            self.arrives_s = None

    async def consume(self, num: int, wait_s: float) -> list[str]:
        self.calls.append(("consume", num, wait_s))
        deadline = time.monotonic() + wait_s
        while len(self.queued) < num and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # simulated time passing in librdkafka
            self._arrived()
        return [self.queued.popleft() for _ in range(min(num, len(self.queued)))]

    async def poll(self, wait_s: float) -> str | None:
        self.calls.append(("poll", 1, wait_s))
        deadline = time.monotonic() + wait_s
        while not self.queued and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # simulated time passing in librdkafka
            self._arrived()
        return self.queued.popleft() if self.queued else None


async def _fetch(consumer: Consumer, timeout_s: float, limit: int = 100) -> list[str]:
    return await fetch(consumer, limit, timeout_s)  # type: ignore[arg-type]


async def test_records_already_fetched_are_taken_without_waiting() -> None:
    """Fewer records than a poll's worth are queued: all of them now, in one call that
    waits for nothing (a consume with the loop's timeout waited it out, every loop)."""
    consumer = Consumer(queued=3)
    messages = await _fetch(consumer, LONG_S)
    assert messages == ["r0", "r1", "r2"]
    assert consumer.calls == [("consume", 100, 0)]


async def test_with_nothing_fetched_the_first_record_to_come_ends_the_wait() -> None:
    """Nothing queued, one record comes 50 ms later: it is taken then, not at the end of
    the timeout; what came with it is taken in the same fetch."""
    consumer = Consumer(queued=0, arrives_s=0.05)
    started = time.monotonic()
    messages = await _fetch(consumer, LONG_S)
    assert messages == ["late"]
    assert time.monotonic() - started < LONG_S / 2
    assert [(name, timeout) for name, _, timeout in consumer.calls] == [
        ("consume", 0),
        ("poll", LONG_S),
        ("consume", 0),
    ]


async def test_nothing_within_the_timeout_is_an_empty_fetch() -> None:
    consumer = Consumer(queued=0)
    assert await _fetch(consumer, 0.02) == []
    assert [name for name, _, _ in consumer.calls] == ["consume", "poll"]


async def test_a_fetch_without_a_timeout_only_takes_what_is_there() -> None:
    consumer = Consumer(queued=0)
    assert await _fetch(consumer, 0.0) == []
    assert consumer.calls == [("consume", 100, 0)]


async def test_a_poll_of_one_record_takes_the_polled_record_alone() -> None:
    consumer = Consumer(queued=0, arrives_s=0.0)
    assert await _fetch(consumer, LONG_S, limit=1) == ["late"]
    assert [name for name, _, _ in consumer.calls] == ["consume", "poll"]
