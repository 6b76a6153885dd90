"""The Kafka edge chosen once: ``WORKER_KAFKA_CLIENT`` names the client library.

``build_edge`` returns the worker's publisher, intake and transactions of the chosen
client; ``open_admin`` the broker questions of ``check``, the start-up gate and the
commands; ``new_writer`` and ``new_reader`` the commands' producer and group-less
consumer. Both clients implement the same contracts (``Publisher``'s producer;
``IntakeEdge`` below; ``worker.kafka.transactions``; ``worker.kafka.admin``;
``worker.kafka.direct``). This is the one module that reads the setting: nothing else
asks which client runs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Protocol

from worker.flow.breaker import CircuitBreaker
from worker.flow.window import Window
from worker.kafka import options as security
from worker.kafka.admin import Admin
from worker.kafka.aiokafka import admin as aio_admin
from worker.kafka.aiokafka import clients
from worker.kafka.aiokafka import direct as aio_direct
from worker.kafka.aiokafka.intake import Intake
from worker.kafka.aiokafka.producer import AioProducer
from worker.kafka.aiokafka.transactions import PerPartitionTransactions, transactional_producer
from worker.kafka.direct import Reader, Writer
from worker.kafka.feed import Admits, Dispatch, Rebalance
from worker.kafka.publisher import LARGEST_RECORD_BYTES, Producer, Publisher
from worker.kafka.rdkafka import config as rdkafka_config
from worker.kafka.transactions import Transactions
from worker.kafka.types import CommitEdge
from worker.observability import Metrics
from worker.settings import KafkaAuthSettings, KafkaSettings, Settings

__all__ = [
    "Edge",
    "IntakeEdge",
    "build_edge",
    "client_name",
    "new_reader",
    "new_writer",
    "open_admin",
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


class Edge(NamedTuple):
    """The chosen client's publisher, intake and transactions."""

    publisher: Publisher
    intake: IntakeEdge
    transactions: Transactions


def _librdkafka(kafka: KafkaSettings) -> bool:
    """True when ``WORKER_KAFKA_CLIENT`` names librdkafka (confluent-kafka), else aiokafka:
    the one place the setting is read."""
    return kafka.kafka_client == "confluent"


def client_name(kafka: KafkaSettings) -> str:
    """The chosen client as ``check`` and the logs name it: aiokafka or librdkafka."""
    return "librdkafka" if _librdkafka(kafka) else "aiokafka"


async def open_admin(kafka: KafkaSettings, auth: KafkaAuthSettings, timeout_s: float) -> Admin:
    """The chosen client's admin, its first broker reached (``where`` names it); raises
    ``admin.Refused`` (a refused handshake: a setting to fix) or ``admin.Unanswered``."""
    if _librdkafka(kafka):
        # Imported here: confluent-kafka is an extra, absent from the base install.
        from worker.kafka.rdkafka.admin import RdAdmin

        return await RdAdmin.open(kafka, auth, timeout_s)
    return await aio_admin.AioAdmin.open(kafka, auth, timeout_s)


def new_writer(
    kafka: KafkaSettings, auth: KafkaAuthSettings, *, suffix: str, max_request_bytes: int
) -> Writer:
    """The chosen client's idempotent producer (not started) of records up to
    ``max_request_bytes``, its client id ``<client id>-<suffix>``; ConfigError for a
    security setting it cannot use."""
    if _librdkafka(kafka):
        # Imported here: confluent-kafka is an extra, absent from the base install.
        from worker.kafka.rdkafka import direct as rd_direct

        return rd_direct.writer(kafka, auth, suffix=suffix, max_request_bytes=max_request_bytes)
    return aio_direct.writer(kafka, auth, suffix=suffix, max_request_bytes=max_request_bytes)


def new_reader(kafka: KafkaSettings, auth: KafkaAuthSettings, *, suffix: str) -> Reader:
    """The chosen client's consumer without a group (not started), ``read_committed``, its
    client id ``<client id>-<suffix>``; ConfigError for a security setting it cannot use."""
    if _librdkafka(kafka):
        from worker.kafka.rdkafka import direct as rd_direct

        return rd_direct.reader(kafka, auth, suffix=suffix)
    return aio_direct.reader(kafka, auth, suffix=suffix)


def build_edge(
    settings: Settings,
    *,
    window: Window,
    breaker: CircuitBreaker,
    metrics: Metrics,
) -> Edge:
    """The publisher, intake and transactions of ``WORKER_KAFKA_CLIENT`` (ConfigError naming
    a setting the client cannot honour)."""
    parts = _librdkafka_parts if _librdkafka(settings.kafka) else _aiokafka_parts
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
    from worker.kafka.rdkafka.transactions import GroupFencedTransactions, transactional_config

    kafka, auth = settings.kafka, settings.kafka_auth
    producer_config = rdkafka_config.producer_config(
        kafka, auth, max_request_bytes=LARGEST_RECORD_BYTES
    )
    intake = RdIntake(
        rdkafka_config.consumer_config(kafka, auth),
        settings.topics.input_topics,
        max_poll_records=kafka.max_poll_records,
        window=window,
        breaker=breaker,
        metrics=metrics,
    )
    config = transactional_config(
        producer_config,
        prefix=settings.delivery.transactional_id_prefix,
        group_id=kafka.group_id,
        client_id=kafka.client_id,
    )
    transactions = GroupFencedTransactions(config, intake.group_metadata)
    return RdProducers(producer_config), intake, transactions


def _aiokafka_parts(
    settings: Settings, window: Window, breaker: CircuitBreaker, metrics: Metrics
) -> tuple[Producer, IntakeEdge, Transactions]:
    kafka, topics = settings.kafka, settings.topics
    largest = LARGEST_RECORD_BYTES
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
    transactions = PerPartitionTransactions(
        kafka.group_id, settings.delivery.transactional_id_prefix, new_transactional
    )
    return producer, intake, transactions
