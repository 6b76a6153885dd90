"""The Kafka edge: the one place the client is chosen, and what each choice builds.

Nothing is started: the parts are built only (no broker is asked at construction).
"""

from __future__ import annotations

import pytest

from worker.flow.breaker import CircuitBreaker
from worker.flow.window import Window
from worker.kafka.aiokafka.intake import Intake
from worker.kafka.aiokafka.producer import AioProducer
from worker.kafka.edge import (
    Edge,
    GroupFenced,
    PerPartition,
    build_edge,
    largest_record_bytes,
    uses_librdkafka,
)
from worker.kafka.publisher import PRODUCER_HEADROOM_BYTES
from worker.observability import Metrics
from worker.settings import Settings, load_settings

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
    for transactions; the publisher writes to the configured topics."""
    s = settings()
    assert not uses_librdkafka(s)
    edge = edge_of(s)
    try:
        assert isinstance(edge.publisher.producer, AioProducer)
        assert isinstance(edge.intake, Intake)
        assert isinstance(edge.transactions, PerPartition)
    finally:  # aiokafka's clients exist from construction: closed, never started
        await edge.publisher.producer.stop()
        await edge.intake.stop()


async def test_confluent_builds_the_librdkafka_parts() -> None:
    """WORKER_KAFKA_CLIENT=confluent: librdkafka's producers and intake, one transactional
    producer fenced by the group, its configuration from the worker's producer's."""
    from worker.kafka.rdkafka.intake import RdIntake
    from worker.kafka.rdkafka.publisher import RdProducers
    from worker.kafka.rdkafka.transactions import GroupTransactions

    s = settings(kafka_client="confluent")
    assert uses_librdkafka(s)
    edge = edge_of(s)
    assert isinstance(edge.publisher.producer, RdProducers)
    assert isinstance(edge.intake, RdIntake)
    assert isinstance(edge.transactions, GroupFenced)
    config = edge.transactions.producer_config
    assert config["message.max.bytes"] == largest_record_bytes(s)
    made = edge.transactions.new_transactions({**config, "transactional.id": "t-1"})
    assert isinstance(made, GroupTransactions)
    assert made.transactional_id == "t-1"


def test_the_largest_record_is_a_dead_letter_of_the_largest_request() -> None:
    """A producer's limit is the larger of the request and result limits, plus headroom
    for a dead letter's headers and key."""
    s = settings(max_request_bytes="2MiB", max_output_bytes="1MiB")
    assert largest_record_bytes(s) == 2 * 2**20 + PRODUCER_HEADROOM_BYTES
    s = settings(max_request_bytes="1MiB", max_output_bytes="3MiB")
    assert largest_record_bytes(s) == 3 * 2**20 + PRODUCER_HEADROOM_BYTES
