"""The aiokafka producer: a write left unsent by the producer it replaced is written again.

aiokafka's ``send_batch`` waits for the partition's pending batch to drain, then appends
its own without checking that the producer was closed meanwhile: appended while
``stop()`` flushes, the batch is never sent and its future never resolves. The chaos
soak met it under load (results of records written alone after a size refusal waited
for ever). What a stopped producer still holds is failed when it is replaced; a batch
appended after that is caught by its write waiting for the ack. A real broker cannot be
made to hit that window on demand (tests/integration/test_publisher.py has the burst that
met the others), so a fake producer stands in for aiokafka here and leaves the first
producer's batch unsent.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from worker.kafka.aiokafka.producer import AioProducer
from worker.kafka.publisher import Publisher, ResultWriteFailed


class _Batch:
    def append(self, **_: Any) -> object:
        return object()

    def close(self) -> None:
        pass


class _Producer:
    """What ``AioProducer.write_alone`` uses of AIOKafkaProducer. The first one made never
    sends a batch (aiokafka's race); the later ones acknowledge each at once."""

    made: list[_Producer] = []

    def __init__(self, **_: Any) -> None:
        self.orphans = not _Producer.made
        self.stopped = False
        # Nothing queued when stopped: the orphan was appended after, out of the sweep's reach.
        self._message_accumulator = SimpleNamespace(_batches={}, _pending_batches=set())
        _Producer.made.append(self)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.stopped = True

    def create_batch(self) -> _Batch:
        return _Batch()

    async def partitions_for(self, _topic: str) -> set[int]:
        return {0}

    async def send_batch(self, _batch: _Batch, _topic: str, *, partition: int) -> Any:
        sent: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        if not self.orphans:
            sent.set_result(f"acked by producer {_Producer.made.index(self)}")
        return sent


@pytest.fixture
def publisher() -> Publisher:
    """A publisher whose producers are the fake above."""
    _Producer.made = []
    producer = AioProducer(_Producer, topics=("out", "dlq"))
    return Publisher(producer, output_topic="out", dlq_topic="dlq")


def _renew(publisher: Publisher) -> Any:
    """Replace the first producer, as a size refusal would."""
    producer = publisher.producer
    assert isinstance(producer, AioProducer)
    return producer._renew_producer(0, RuntimeError("a size refusal"))


async def test_a_write_left_unsent_by_a_replaced_producer_goes_out_on_the_new_one(
    publisher: Publisher,
) -> None:
    """A write waiting on the first producer, which is replaced and stopped: written again on
    the second one (before, it waited for ever)."""
    await publisher.start()
    alone = asyncio.create_task(publisher._send_alone("out", b"alone", b"k", [], ResultWriteFailed))
    # One turn of the loop: the write sends its batch and waits for the ack.
    await asyncio.sleep(0)
    assert not alone.done()
    await _renew(publisher)
    assert _Producer.made[0].stopped
    assert await asyncio.wait_for(alone, 5) == "acked by producer 1"


async def test_a_write_acked_before_its_producer_is_stopped_is_not_written_again(
    publisher: Publisher,
) -> None:
    """An ack that came before the stop stands: the write is not sent a second time."""
    await publisher.start()
    _Producer.made[0].orphans = False
    assert await publisher._send_alone("out", b"v", b"k", [], ResultWriteFailed) == (
        "acked by producer 0"
    )
    await _renew(publisher)
    assert len(_Producer.made) == 2
