"""The Kafka edge chosen once, at start-up: ``WORKER_KAFKA_CLIENT`` names the client library.

``build_edge`` returns the publisher, the intake and the transactions of the chosen client;
both clients implement the same contract (``Publisher``'s methods; ``IntakeEdge`` below),
and the transactions say how the client fences them (``PerPartition`` or ``GroupFenced``).
Nothing else reads the setting: delivery asks the edge, the checks ``uses_librdkafka``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from worker.flow.breaker import CircuitBreaker
from worker.flow.window import Window
from worker.kafka import options as security
from worker.kafka.aiokafka import clients
from worker.kafka.aiokafka.intake import Intake
from worker.kafka.aiokafka.producer import AioProducer
from worker.kafka.aiokafka.transactions import ProducerFactory, transactional_producer
from worker.kafka.feed import Admits, Dispatch, Rebalance
from worker.kafka.publisher import PRODUCER_HEADROOM_BYTES, Producer, Publisher
from worker.kafka.rdkafka import config as rdkafka_config
from worker.kafka.types import CommitEdge
from worker.observability import Metrics
from worker.settings import Settings

if TYPE_CHECKING:
    from worker.kafka.rdkafka.transactions import GroupTransactions

__all__ = [
    "Edge",
    "GroupFenced",
    "IntakeEdge",
    "PerPartition",
    "Transactions",
    "build_edge",
    "largest_record_bytes",
    "uses_librdkafka",
]


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


class PerPartition(NamedTuple):
    """aiokafka's transactions: a producer per input partition, fenced by its transactional id
    (aiokafka has no group-metadata fencing, KIP-447)."""

    new_producer: ProducerFactory


class GroupFenced(NamedTuple):
    """librdkafka's transactions: one producer per worker, fenced by the group (KIP-447)."""

    #: The worker's producer configuration, which the transactional one starts from.
    producer_config: dict[str, Any]
    #: The transactional producer of a complete configuration.
    new_transactions: Callable[[Mapping[str, Any]], GroupTransactions]


#: How the chosen client writes outcomes and offsets in one transaction (exactly_once).
Transactions = PerPartition | GroupFenced


class Edge(NamedTuple):
    """The chosen client's publisher, intake and transactions."""

    publisher: Publisher
    intake: IntakeEdge
    transactions: Transactions


def uses_librdkafka(settings: Settings) -> bool:
    """True when ``WORKER_KAFKA_CLIENT`` names librdkafka (confluent-kafka), else aiokafka;
    the one place the setting is read."""
    return settings.kafka.kafka_client == "confluent"


def _group_transactions(config: Mapping[str, Any]) -> GroupTransactions:
    # Imported here: confluent-kafka is an extra, absent from the base install.
    from worker.kafka.rdkafka.transactions import GroupTransactions

    return GroupTransactions(config)


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
    """The publisher, intake and transactions of ``WORKER_KAFKA_CLIENT`` (ConfigError naming
    a setting the client cannot honour)."""
    parts = _librdkafka_parts if uses_librdkafka(settings) else _aiokafka_parts
    producer, intake, transactions = parts(settings, window, breaker, metrics)
    publisher = Publisher(
        producer,
        output_topic=settings.topics.output_topic,
        dlq_topic=settings.topics.dlq_topic,
        on_value_omitted=metrics.dead_letter_values_omitted_total.inc,
    )
    return Edge(publisher, intake, transactions)


def _librdkafka_parts(
    settings: Settings, window: Window, breaker: CircuitBreaker, metrics: Metrics
) -> tuple[Producer, IntakeEdge, Transactions]:
    # Imported here: confluent-kafka is an extra, absent from the base install.
    from worker.kafka.rdkafka.intake import RdIntake
    from worker.kafka.rdkafka.publisher import RdProducers

    kafka, auth = settings.kafka, settings.kafka_auth
    largest = largest_record_bytes(settings)
    producer_config = rdkafka_config.producer_config(kafka, auth, max_request_bytes=largest)
    intake = RdIntake(
        rdkafka_config.consumer_config(kafka, auth),
        settings.topics.input_topics,
        max_poll_records=kafka.max_poll_records,
        window=window,
        breaker=breaker,
        metrics=metrics,
    )
    transactions = GroupFenced(producer_config, _group_transactions)
    return RdProducers(producer_config), intake, transactions


def _aiokafka_parts(
    settings: Settings, window: Window, breaker: CircuitBreaker, metrics: Metrics
) -> tuple[Producer, IntakeEdge, Transactions]:
    kafka, topics = settings.kafka, settings.topics
    largest = largest_record_bytes(settings)
    auth = settings.kafka_auth
    # Options of its own for the producer, the consumer and the transactional producers.
    new_producer = functools.partial(
        clients.producer,
        kafka,
        security.kafka_client_kwargs(auth),
        **clients.idempotent(largest),
    )
    producer = AioProducer(new_producer, topics=(topics.output_topic, topics.dlq_topic))
    intake = Intake(
        kafka,
        topics.input_topics,
        client_kwargs=security.kafka_client_kwargs(auth),
        window=window,
        breaker=breaker,
        metrics=metrics,
    )
    new_transactional = functools.partial(
        transactional_producer,
        kafka,
        client_kwargs=security.kafka_client_kwargs(auth),
        max_request_bytes=largest,
    )
    return producer, intake, PerPartition(new_transactional)
