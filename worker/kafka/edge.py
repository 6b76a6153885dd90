"""The Kafka edge chosen once, at start-up: ``WORKER_KAFKA_CLIENT`` names the client library.

``build_edge`` returns the publisher and the intake of the chosen client; both clients
implement the same contract (``Publisher``'s methods; ``IntakeEdge`` below), so nothing
outside ``worker.kafka`` (and the transactions of ``worker.delivery``) knows which runs.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from worker.flow.breaker import CircuitBreaker
from worker.flow.window import Window
from worker.kafka import options as security
from worker.kafka.aiokafka.intake import Intake
from worker.kafka.feed import Admits, Dispatch, Rebalance
from worker.kafka.publisher import PRODUCER_HEADROOM_BYTES, Publisher
from worker.kafka.rdkafka import config as rdkafka_config
from worker.kafka.types import CommitEdge
from worker.observability import Metrics
from worker.settings import Settings

__all__ = ["Edge", "IntakeEdge", "build_edge", "largest_record_bytes"]


class IntakeEdge(CommitEdge, Protocol):
    """The consumer side: the fetch loop's lifecycle, and what delivery asks of it."""

    running: bool

    async def start(self, rebalance: Rebalance) -> None:
        """Subscribe and join the group; ``rebalance`` is told of assignment changes."""
        ...

    async def run(self, dispatch: Dispatch, admits: Admits) -> None:
        """Fetch and ``dispatch`` the records that ``admits`` lets through, until stopped."""
        ...

    def request_stop(self) -> None: ...

    async def stop(self) -> None: ...


class Edge(NamedTuple):
    """The chosen client's publisher and intake."""

    publisher: Publisher
    intake: IntakeEdge


def largest_record_bytes(settings: Settings) -> int:
    """The largest record a producer sends: a dead letter carries the request as it came."""
    limits = settings.limits
    return max(limits.max_output_bytes, limits.max_request_bytes) + PRODUCER_HEADROOM_BYTES


def build_edge(
    settings: Settings,
    *,
    window: Window,
    breaker: CircuitBreaker,
    metrics: Metrics,
) -> Edge:
    """The publisher and intake of ``WORKER_KAFKA_CLIENT`` (ConfigError naming a setting
    the client cannot honour)."""
    kafka, auth, topics = settings.kafka, settings.kafka_auth, settings.topics
    largest = largest_record_bytes(settings)
    omitted = metrics.dead_letter_values_omitted_total.inc
    if kafka.kafka_client == "confluent":
        # Imported here: confluent-kafka is an extra, absent from the base install.
        from worker.kafka.rdkafka.intake import RdIntake
        from worker.kafka.rdkafka.publisher import RdPublisher

        publisher: Publisher = RdPublisher(
            rdkafka_config.producer_config(kafka, auth, max_request_bytes=largest),
            output_topic=topics.output_topic,
            dlq_topic=topics.dlq_topic,
            on_value_omitted=omitted,
        )
        intake: IntakeEdge = RdIntake(
            rdkafka_config.consumer_config(kafka, auth),
            topics.input_topics,
            max_poll_records=kafka.max_poll_records,
            window=window,
            breaker=breaker,
            metrics=metrics,
        )
        return Edge(publisher, intake)
    publisher = Publisher(
        kafka.bootstrap_servers,
        output_topic=topics.output_topic,
        dlq_topic=topics.dlq_topic,
        client_id=kafka.client_id,
        linger_ms=kafka.linger_ms,
        max_request_bytes=largest,
        client_kwargs=security.kafka_client_kwargs(auth),
        compression_type=kafka.compression_type,
        on_value_omitted=omitted,
    )
    intake = Intake(
        kafka,
        topics.input_topics,
        client_kwargs=security.kafka_client_kwargs(auth),
        window=window,
        breaker=breaker,
        metrics=metrics,
    )
    return Edge(publisher, intake)
