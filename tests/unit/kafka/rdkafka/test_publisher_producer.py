"""RdProducer: delivery reports go on after a fatal error, which confluent-kafka raises from poll.

librdkafka's producer is the in-memory fake of ``rdkafka_fakes``: a real broker cannot
be made to raise a fatal producer error on demand.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.kafka.rdkafka.fakes import Broker, KafkaError, rd_error
from worker.kafka.rdkafka.publisher import RdProducer

pytestmark = pytest.mark.timeout(10)


async def test_poll_thread_survives_a_fatal_error_raised_from_poll(broker: Broker) -> None:
    """poll raises a fatal error once: polling goes on and a record's report still arrives."""
    broker.poll_error = rd_error(KafkaError.INVALID_TXN_STATE, fatal=True)
    producer = RdProducer({"bootstrap.servers": "127.0.0.1:9"})
    await producer.start()
    try:
        report = await producer.send("out", b"value", None, [])
        assert await asyncio.wait_for(report, 5) == b"value"
        assert broker.poll_error is None  # it was raised
    finally:
        await producer.stop()
