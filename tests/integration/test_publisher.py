"""The publisher on a real broker (either client): a record refused for its size never blocks
later writes."""

from __future__ import annotations

import asyncio
import functools

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from tests.support import KafkaUnderTest, Topics
from tests.support.worker import kafka_client_under_test
from worker import errors
from worker.kafka.aiokafka import clients
from worker.kafka.aiokafka.producer import AioProducer
from worker.kafka.publisher import Publisher
from worker.kafka.rdkafka.config import producer_config
from worker.kafka.rdkafka.publisher import RdProducers
from worker.settings import load_settings
from worker.wire import header_value

pytestmark = pytest.mark.timeout(60)

#: The topics' max.message.bytes, and a value the broker refuses under it.
LIMIT = 64 * 1024
TOO_BIG = b"x" * (LIMIT + 36 * 1024)
#: The producers' own bound on a record: far above the topics' limit.
MAX_BYTES = 8 * 1024 * 1024


async def read_all(bootstrap: str, topic: str) -> list[ConsumerRecord[bytes, bytes]]:
    """Every record of partition 0 of ``topic``, up to its end offset."""
    return await _read_partition(bootstrap, topic, 0)


async def _read_partition(
    bootstrap: str, topic: str, partition: int
) -> list[ConsumerRecord[bytes, bytes]]:
    """Every record of one partition of ``topic``, up to its end offset."""
    tp = TopicPartition(topic, partition)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    consumer.assign([tp])
    await consumer.start()
    try:
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        records: list[ConsumerRecord[bytes, bytes]] = []
        while await consumer.position(tp) < end:
            for batch in (await consumer.getmany(tp, timeout_ms=1000)).values():
                records.extend(batch)
        return records
    finally:
        await consumer.stop()


def _publisher(kafka: KafkaUnderTest, topics: Topics, unique: str) -> Publisher:
    """The publisher of the client under test (WORKER_TEST_KAFKA_CLIENT)."""
    client = kafka_client_under_test()
    settings = load_settings(
        {
            "WORKER_INPUT_TOPICS": topics.input,
            "WORKER_OUTPUT_TOPIC": topics.output,
            "WORKER_DLQ_TOPIC": topics.dlq,
            "WORKER_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
            "WORKER_CLIENT_ID": f"publisher-{unique}",
            "WORKER_KAFKA_CLIENT": client,
        }
    )
    if client == "confluent":
        config = producer_config(settings.kafka, settings.kafka_auth, max_request_bytes=MAX_BYTES)
        return Publisher(RdProducers(config), output_topic=topics.output, dlq_topic=topics.dlq)
    new_producer = functools.partial(
        clients.producer, settings.kafka, {}, **clients.idempotent(MAX_BYTES)
    )
    producer = AioProducer(new_producer, topics=(topics.output, topics.dlq))
    return Publisher(producer, output_topic=topics.output, dlq_topic=topics.dlq)


async def test_writes_to_a_partition_go_on_after_the_broker_refuses_one_for_its_size(
    kafka: KafkaUnderTest, unique: str
) -> None:
    """A result and a dead letter over max.message.bytes: refused alone, every later write lands."""
    topics = Topics.fresh(unique)
    await kafka.create_topics(
        [topics.output, topics.dlq], partitions=1, configs={"max.message.bytes": str(LIMIT)}
    )
    publisher = _publisher(kafka, topics, unique)
    await publisher.start()
    try:
        # 1. One at a time: the refused record follows an accepted one on the same
        # partition, so the producer has sequence state there.
        await publisher.write_result(b"r-before", b"k", [])
        with pytest.raises(errors.OutputTooLarge):
            await publisher.write_result(TOO_BIG, b"k", [])
        await publisher.write_result(b"r-after", b"k", [])
        # 2. Side by side: the refused record shares batches with innocent ones.
        concurrent = await asyncio.gather(
            publisher.write_result(TOO_BIG, b"k", []),
            *(publisher.write_result(f"r-{i}".encode(), b"k", []) for i in range(5)),
            return_exceptions=True,
        )
        assert isinstance(concurrent[0], errors.OutputTooLarge), concurrent[0]
        assert not [c for c in concurrent[1:] if isinstance(c, BaseException)], concurrent
        # 3. Dead letters: one kept whole, one written without its value, one after it.
        await publisher.write_dead_letter(b"d-before", b"k", [("x-error-code", b"X")])
        await publisher.write_dead_letter(TOO_BIG, b"k", [("x-error-code", b"X")])
        await publisher.write_dead_letter(b"d-after", b"k", [("x-error-code", b"X")])
    finally:
        await publisher.stop()

    results = [r.value for r in await read_all(kafka.bootstrap_servers, topics.output)]
    assert results[:2] == [b"r-before", b"r-after"]
    assert sorted(results[2:]) == [f"r-{i}".encode() for i in range(5)]
    letters = await read_all(kafka.bootstrap_servers, topics.dlq)
    assert [r.value for r in letters] == [b"d-before", b"", b"d-after"]
    assert header_value(letters[1].headers, "x-value-omitted") == b"true"
    assert header_value(letters[1].headers, "x-original-value-bytes") == str(len(TOO_BIG)).encode()


async def test_several_results_of_one_record_land_in_order_and_a_refused_one_stops_them(
    kafka: KafkaUnderTest, unique: str
) -> None:
    """publish_results: 20 results in order; in [a, too big, b], a lands, then OUTPUT_TOO_LARGE."""
    topics = Topics.fresh(unique)
    await kafka.create_topics(
        [topics.output, topics.dlq], partitions=1, configs={"max.message.bytes": str(LIMIT)}
    )
    publisher = _publisher(kafka, topics, unique)
    record = ConsumerRecord("in", 0, 0, 0, 0, b"k", b"", None, 1, 0, [])
    await publisher.start()
    try:
        await publisher.publish_results(record, [(f"r-{i}".encode(), []) for i in range(20)])
        with pytest.raises(errors.OutputTooLarge):
            await publisher.publish_results(record, [(b"a", []), (TOO_BIG, []), (b"b", [])])
    finally:
        await publisher.stop()

    values = [r.value for r in await read_all(kafka.bootstrap_servers, topics.output)]
    assert values == [f"r-{i}".encode() for i in range(20)] + [b"a"]


async def test_results_of_many_records_are_sent_together_and_a_refused_one_is_reported(
    kafka: KafkaUnderTest, unique: str
) -> None:
    """publish_many: ten results acked together; the too-big one comes back as its error, and
    written again alone (as the fast path's fallback does) it is OUTPUT_TOO_LARGE, the rest land."""
    topics = Topics.fresh(unique)
    await kafka.create_topics(
        [topics.output, topics.dlq], partitions=1, configs={"max.message.bytes": str(LIMIT)}
    )
    publisher = _publisher(kafka, topics, unique)
    records = [ConsumerRecord("in", 0, i, 0, 0, b"k", b"", None, 1, 0, []) for i in range(10)]
    await publisher.start()
    try:
        calls: list[int] = []
        first = await publisher.publish_many(
            [(r, f"a-{r.offset}".encode(), []) for r in records],
            enqueued=lambda: calls.append(len(calls)),
        )
        assert first == [None] * 10
        assert calls == [0]  # told once, when all ten were enqueued
        values = [f"b-{r.offset}".encode() if r.offset != 4 else TOO_BIG for r in records]
        # Headers as results carry them (librdkafka's report of a refused record may not).
        second = await publisher.publish_many(
            [
                (r, v, [("x-source-offset", str(r.offset).encode()), ("x-trace", None)])
                for r, v in zip(records, values, strict=True)
            ]
        )
        assert isinstance(second[4], Exception), second
        # The broker refuses whole batches: neighbours of the refused one may fail with it.
        refused = []
        for record, value, outcome in zip(records, values, second, strict=True):
            if outcome is None:
                continue
            try:
                await publisher.publish_result(record, value, [])
            except errors.OutputTooLarge:
                refused.append(record.offset)
    finally:
        await publisher.stop()

    assert refused == [4]
    landed = [r.value for r in await read_all(kafka.bootstrap_servers, topics.output)]
    assert landed[:10] == [f"a-{i}".encode() for i in range(10)]
    assert sorted(set(landed[10:])) == sorted(f"b-{i}".encode() for i in range(10) if i != 4)


async def test_a_burst_of_results_over_the_limit_leaves_no_write_waiting(
    kafka: KafkaUnderTest, unique: str
) -> None:
    """32 writers, one result in 40 over max.message.bytes, each result followed by a dead
    letter: each small result and every dead letter lands, each big result is
    OUTPUT_TOO_LARGE, none waits (aiokafka: each refusal replaces the producer; writes caught
    on a producer being closed waited up to the request timeout or for ever, among them a
    first dead letter waiting for its topic's metadata on a fresh producer, and a write
    replaced five times in a row stopped the worker)."""
    topics = Topics.fresh(unique)
    await kafka.create_topics(
        [topics.output, topics.dlq], partitions=2, configs={"max.message.bytes": str(LIMIT)}
    )
    publisher = _publisher(kafka, topics, unique)
    big = {(w, i) for w in range(32) for i in range(100) if (w * 100 + i) % 40 == 17}

    async def writer(w: int) -> None:
        for i in range(100):
            value = TOO_BIG if (w, i) in big else f"r-{w}-{i}".encode()
            write = publisher.write_result(value, f"k{i % 7}".encode(), [])
            if (w, i) in big:
                with pytest.raises(errors.OutputTooLarge):
                    await asyncio.wait_for(write, 20)
            else:
                await asyncio.wait_for(write, 20)
            letter = publisher.write_dead_letter(f"d-{w}-{i}".encode(), b"k", [])
            await asyncio.wait_for(letter, 20)

    await publisher.start()
    try:
        await asyncio.gather(*(writer(w) for w in range(32)))
    finally:
        await publisher.stop()
    landed = set()
    for p in range(2):
        tp_records = await _read_partition(kafka.bootstrap_servers, topics.output, p)
        landed |= {r.value for r in tp_records}
    want = {f"r-{w}-{i}".encode() for w in range(32) for i in range(100) if (w, i) not in big}
    assert want <= landed
    letters = set()
    for p in range(2):
        letters |= {r.value for r in await _read_partition(kafka.bootstrap_servers, topics.dlq, p)}
    assert letters == {f"d-{w}-{i}".encode() for w in range(32) for i in range(100)}
