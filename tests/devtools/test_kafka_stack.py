"""The local Kafka broker is a real Apache Kafka: topics, groups, commits, failover."""

from __future__ import annotations

import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from devtools.devstack.kafka import KafkaCluster
from tests.support import KafkaUnderTest


async def test_produce_consume_commit_read_back(kafka: KafkaUnderTest, unique: str) -> None:
    """A topic is created, records go through a consumer group, the commit reads back."""
    topic, group = f"roundtrip-{unique}", f"group-{unique}"
    await kafka.create_topics([topic], partitions=2)
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka.bootstrap_servers, acks="all", enable_idempotence=True
    )
    await producer.start()
    try:
        for i in range(20):
            await producer.send_and_wait(topic, f"v{i}".encode(), partition=i % 2)
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka.bootstrap_servers,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        seen: list[bytes] = []
        while len(seen) < 20:
            batch = await consumer.getmany(timeout_ms=5000)
            assert batch, "no records within 5 s"
            seen += [r.value for records in batch.values() for r in records]
        await consumer.commit()
    finally:
        await consumer.stop()

    assert sorted(seen) == sorted(f"v{i}".encode() for i in range(20))
    committed = await kafka.committed_offsets(group)
    assert committed == {TopicPartition(topic, 0): 10, TopicPartition(topic, 1): 10}


async def test_three_nodes_survive_leader_stop(cluster3: KafkaCluster, unique: str) -> None:
    """Stopping the leader of a partition moves leadership; producing goes on."""
    topic = f"failover-{unique}"
    await cluster3.create_topics([topic], partitions=1, replication=3)
    old_leader = await cluster3.leader(topic, 0)
    assert old_leader in {1, 2, 3}

    producer = AIOKafkaProducer(
        bootstrap_servers=cluster3.bootstrap_servers, acks="all", enable_idempotence=True
    )
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"before")
        cluster3.stop_node(old_leader)
        started = time.monotonic()
        await producer.send_and_wait(topic, b"after")
        failover_s = time.monotonic() - started
    finally:
        await producer.stop()

    new_leader = await cluster3.leader(topic, 0)
    assert new_leader not in {old_leader, -1}
    assert failover_s < 30
    cluster3.start_node(old_leader)
    assert sorted(cluster3.running_nodes()) == [1, 2, 3]
