"""The Kafka edge: the one place the client is chosen, and what each choice builds (the
worker's parts, and the commands' writer and reader).

Nothing is started: the parts are built only (no broker is asked at construction).
"""

from __future__ import annotations

import pytest
from aiokafka.structs import TopicPartition

from worker.flow.breaker import CircuitBreaker
from worker.flow.window import Window
from worker.kafka.aiokafka.intake import Intake
from worker.kafka.aiokafka.producer import AioProducer
from worker.kafka.aiokafka.transactions import PerPartitionTransactions
from worker.kafka.edge import Edge, build_edge, client_name, new_reader, new_writer
from worker.kafka.publisher import LARGEST_RECORD_BYTES
from worker.observability import Metrics
from worker.settings import KafkaAuthSettings, Settings, load_settings

pytestmark = pytest.mark.timeout(10)


def settings(**extra: str) -> Settings:
    env = {
        "WORKER_INPUT_TOPICS": "in",
        "WORKER_OUTPUT_TOPIC": "out",
        "WORKER_DLQ_TOPIC": "dlq",
        **{f"WORKER_{k.upper()}": v for k, v in extra.items()},
    }
    return load_settings(env)


def edge_of(s: Settings) -> Edge:
    return build_edge(
        s, window=Window(8, 4), breaker=CircuitBreaker(3), metrics=Metrics(version="test")
    )


async def test_aiokafka_is_the_default_client() -> None:
    """No WORKER_KAFKA_CLIENT: aiokafka's producer and intake, a producer per partition
    for transactions, each partition's id naming the group and the partition."""
    s = settings(group_id="g")
    assert client_name(s.kafka) == "aiokafka"
    edge = edge_of(s)
    try:
        assert isinstance(edge.publisher.producer, AioProducer)
        assert isinstance(edge.intake, Intake)
        assert isinstance(edge.transactions, PerPartitionTransactions)
        assert edge.transactions.seeks_committed and not edge.transactions.shared
        producer = edge.transactions.producer_for(TopicPartition("in", 3))
        assert producer.transactional_id == "kafka-triton-worker-g-in-3"
    finally:  # aiokafka's clients exist from construction: closed, never started
        await edge.publisher.producer.stop()
        await edge.intake.stop()


async def test_confluent_builds_the_librdkafka_parts() -> None:
    """WORKER_KAFKA_CLIENT=confluent: librdkafka's producers and intake, one transactional
    producer for every partition, fenced by the group, no seek after an assignment."""
    from worker.kafka.rdkafka.intake import RdIntake
    from worker.kafka.rdkafka.publisher import RdProducers
    from worker.kafka.rdkafka.transactions import GroupFencedTransactions

    s = settings(kafka_client="confluent")
    assert client_name(s.kafka) == "librdkafka"
    edge = edge_of(s)
    assert isinstance(edge.publisher.producer, RdProducers)
    assert isinstance(edge.intake, RdIntake)
    transactions = edge.transactions
    assert isinstance(transactions, GroupFencedTransactions)
    assert transactions.shared and not transactions.seeks_committed
    first = transactions.producer_for(TopicPartition("in", 0))
    assert first is transactions.producer_for(TopicPartition("in", 1))


def test_members_sharing_a_client_id_have_transactional_ids_of_their_own() -> None:
    """Two members with the same WORKER_CLIENT_ID (one set for quotas): each transactional
    id is its own, under the prefix (an ACL on the prefix covers it). Before, both were
    <prefix>-<group>-<client id>: each member's start fenced the other's producer, in turn,
    for ever."""
    from worker.kafka.rdkafka.transactions import GroupFencedTransactions

    s = settings(kafka_client="confluent", client_id="shared", group_id="g")
    ids = set()
    for _ in range(2):
        transactions = edge_of(s).transactions
        assert isinstance(transactions, GroupFencedTransactions)
        ids.add(transactions.producer.transactional_id)
    assert len(ids) == 2
    assert all(i.startswith("kafka-triton-worker-g-shared-") for i in ids)


def test_no_record_is_refused_by_the_producers_own_limit() -> None:
    """The producers' own limit is librdkafka's highest, whatever the request and result
    limits: a dead letter of a request far over WORKER_MAX_REQUEST_BYTES is judged by the
    broker (the dead-letter topic's limit), not dropped to its headers by the producer
    (before, the limit was the larger of the two limits plus 64 KiB)."""
    from worker.kafka.rdkafka.publisher import RdProducers

    s = settings(max_request_bytes="3MiB", kafka_client="confluent")
    producer = edge_of(s).publisher.producer
    assert isinstance(producer, RdProducers)
    assert producer._rd._config["message.max.bytes"] == LARGEST_RECORD_BYTES == 1_000_000_000


async def test_the_commands_clients_are_aiokafkas_by_default() -> None:
    """No WORKER_KAFKA_CLIENT: the commands' writer and reader are aiokafka's, named for the
    command (built only: closed, never started)."""
    from worker.kafka.aiokafka.direct import AioReader, AioWriter

    kafka = settings(client_id="c").kafka
    writer = new_writer(kafka, KafkaAuthSettings(), suffix="produce", max_request_bytes=1 << 20)
    reader = new_reader(kafka, KafkaAuthSettings(), suffix="tail")
    try:
        assert isinstance(writer, AioWriter)
        assert isinstance(reader, AioReader)
        assert writer._producer.client._client_id == "c-produce"
        assert reader._consumer._client._client_id == "c-tail"
    finally:
        await writer.stop()
        await reader.stop()


def test_the_commands_clients_are_librdkafkas_under_confluent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WORKER_KAFKA_CLIENT=confluent: the commands' writer and reader are librdkafka's, and
    no aiokafka client is built for them (its constructors fail here). The writer chooses a
    key's partition as aiokafka does; the reader reads read_committed and commits nothing."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from worker.kafka.rdkafka.direct import RdReader
    from worker.kafka.rdkafka.publisher import RdProducer

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("an aiokafka client built under WORKER_KAFKA_CLIENT=confluent")

    monkeypatch.setattr(AIOKafkaProducer, "__init__", refused)
    monkeypatch.setattr(AIOKafkaConsumer, "__init__", refused)
    kafka = settings(client_id="c", kafka_client="confluent").kafka
    writer = new_writer(kafka, KafkaAuthSettings(), suffix="replay", max_request_bytes=2 << 20)
    reader = new_reader(kafka, KafkaAuthSettings(), suffix="replay")
    assert isinstance(writer, RdProducer)
    assert isinstance(reader, RdReader)
    produced = writer._config
    assert (produced["client.id"], produced["partitioner"]) == ("c-replay", "murmur2_random")
    assert (produced["acks"], produced["enable.idempotence"]) == ("all", True)
    assert produced["message.max.bytes"] == 2 << 20
    read = reader._config
    assert (read["client.id"], read["isolation.level"]) == ("c-replay", "read_committed")
    assert read["enable.auto.commit"] is False
