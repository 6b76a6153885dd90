"""What only the librdkafka edge has to get right: records as librdkafka hands them over."""

from __future__ import annotations

import asyncio
from typing import Any

import confluent_kafka

from devtools import samples
from tests.support.kafka import Topics, collect, create
from tests.support.worker import running_worker, settings_for


async def test_header_keys_that_are_not_utf8_do_not_stop_the_partition(
    kafka: Any, triton: Any, unique: str
) -> None:
    """A header whose key is not UTF-8 is read with replacement characters: answered, and
    the records behind it too (the confluent client)."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    odd, *rest = samples.good_requests(3, seed=91, models=("double",))
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka.bootstrap_servers})
    producer.produce(
        topics.input,
        odd.value,
        key=odd.request_id.encode(),
        headers=[*odd.headers, (b"x-\xff\xfe", b"odd key")],
    )
    for request in rest:
        producer.produce(
            topics.input, request.value, key=request.request_id.encode(), headers=request.headers
        )
    assert await asyncio.to_thread(producer.flush, 30) == 0
    settings = settings_for(kafka, triton, topics, kafka_client="confluent")
    async with running_worker(settings):
        got = await collect(kafka.bootstrap_servers, topics, 3)
    assert got.dead_letters == {}
    assert set(got.results) == {odd.request_id, *(r.request_id for r in rest)}
