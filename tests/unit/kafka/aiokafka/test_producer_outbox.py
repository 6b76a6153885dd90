"""The aiokafka producer's outboxes: results written together by several writers while a
partition's batch waits to go out leave in one batch, in the order they were written.

aiokafka takes one batch per partition into each produce request and makes ``send_batch``
wait until the partition's pending batch has gone out; whether writers coalesce depends
on when a request completes, which a real broker does not let a test choose. A fake
producer stands in for aiokafka here: its partition's pending batch goes out when the
test says so.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from worker.kafka.aiokafka.producer import AioProducer


class _Builder:
    def __init__(self) -> None:
        self.values: list[bytes] = []
        self.closed = False

    def append(self, *, value: bytes, **_: Any) -> object | None:
        assert not self.closed, "appended to a batch already handed over"
        self.values.append(value)
        return object()

    def close(self) -> None:
        self.closed = True


class _Producer:
    """What ``send_together`` uses of AIOKafkaProducer, one partition. ``send_batch`` waits
    while a batch handed before is pending (until ``drain``); each ack waits for ``ack``."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []
        self.pending: asyncio.Event | None = None
        self.acks: list[asyncio.Future[None]] = []

    def create_batch(self) -> _Builder:
        return _Builder()

    async def partitions_for(self, _topic: str) -> set[int]:
        return {0}

    async def send_batch(self, batch: _Builder, _topic: str, *, partition: int) -> Any:
        while self.pending is not None:
            await self.pending.wait()
        self.pending = asyncio.Event()
        self.sent.append(batch.values)
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.acks.append(ack)
        return ack

    def drain(self) -> None:
        """The pending batch goes out in a request: the next one may be handed over."""
        assert self.pending is not None
        pending, self.pending = self.pending, None
        pending.set()

    def ack_all(self) -> None:
        for ack in self.acks:
            if not ack.done():
                ack.set_result(None)


@pytest.fixture
def fake() -> _Producer:
    return _Producer()


@pytest.fixture
def producer(fake: _Producer) -> AioProducer:
    return AioProducer(lambda: fake, topics=("out",))


def _records(*values: str) -> list[tuple[bytes | None, bytes, list[tuple[str, bytes | None]]]]:
    return [(b"k", value.encode(), []) for value in values]


async def _until(condition: Any) -> None:
    """Let the loop run until ``condition()`` holds (each step: one pass of the loop)."""
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def test_results_written_while_a_batch_waits_go_out_together_in_order(
    producer: AioProducer, fake: _Producer
) -> None:
    """a's batch is pending, b's waits to be handed over: c and d write meanwhile, and
    their results leave together in the next batch, c's before d's; each writer is told
    once its own results are enqueued, and every result is acknowledged."""
    told: list[str] = []

    def write(name: str, *values: str) -> asyncio.Task[list[BaseException | None]]:
        records = _records(*values)
        return asyncio.create_task(
            producer.send_together("out", records, lambda: told.append(name))
        )

    a = write("a", "a1", "a2")
    await _until(lambda: told == ["a"])
    b = write("b", "b1")
    box = producer._outboxes[("out", 0)]
    await _until(lambda: box.lock.locked() and not box.batches)  # b took its batch
    c, d = write("c", "c1", "c2"), write("d", "d1")
    for _ in range(5):
        await asyncio.sleep(0)
    assert fake.sent == [[b"a1", b"a2"]]  # b, c and d wait for a's batch to go out
    assert told == ["a"]

    fake.drain()
    await _until(lambda: told == ["a", "b"])
    fake.drain()
    await _until(lambda: told == ["a", "b", "c", "d"])
    assert fake.sent == [[b"a1", b"a2"], [b"b1"], [b"c1", b"c2", b"d1"]]

    fake.ack_all()
    assert [await task for task in (a, b, c, d)] == [[None, None], [None], [None, None], [None]]


async def test_a_hand_over_cancelled_fails_its_batch_and_the_outbox_goes_on(
    producer: AioProducer, fake: _Producer
) -> None:
    """The writer handing over b's and c's batch is cancelled (a forced stop) while it
    waits: c's result comes back as not written (c writes it again alone), and a later
    writer's results still go out."""
    x = asyncio.create_task(producer.send_together("out", _records("x1")))
    await _until(lambda: len(fake.sent) == 1)
    a = asyncio.create_task(producer.send_together("out", _records("a1")))
    box = producer._outboxes[("out", 0)]
    await _until(lambda: box.lock.locked() and not box.batches)  # a took its batch
    b = asyncio.create_task(producer.send_together("out", _records("b1")))
    c = asyncio.create_task(producer.send_together("out", _records("c1")))
    fake.drain()  # x's batch goes out: a's is handed over, b takes b1 and c1
    await _until(lambda: len(fake.sent) == 2 and box.lock.locked() and not box.batches)
    b.cancel()
    (outcome,) = await c
    assert outcome is not None  # not written: c writes it again alone

    d = asyncio.create_task(producer.send_together("out", _records("d1")))
    fake.drain()
    await _until(lambda: len(fake.sent) == 3)
    fake.ack_all()
    assert [await task for task in (x, a, d)] == [[None], [None], [None]]
    assert fake.sent == [[b"x1"], [b"a1"], [b"d1"]]
    with pytest.raises(asyncio.CancelledError):
        await b
