"""When a record is done and what is committed: one ``Delivery`` per mode, chosen once.

``at_least_once``: done once the broker acknowledged the outcome; offsets committed
through the consumer. ``exactly_once``: outcomes and offsets in one Kafka
transaction per input partition (aiokafka), or in one transaction for every
partition, fenced by the group generation (librdkafka).
"""

from __future__ import annotations

import functools
from typing import cast

from worker.delivery.at_least_once import AtLeastOnce
from worker.delivery.base import Delivery, Publishing, Sink
from worker.delivery.exactly_once import ExactlyOnce
from worker.delivery.offsets import OffsetTracker
from worker.kafka.aiokafka.transactions import transactional_producer
from worker.kafka.options import kafka_client_kwargs
from worker.kafka.rdkafka import config as rdkafka_config
from worker.kafka.types import CommitEdge
from worker.observability import Metrics
from worker.settings import Settings

__all__ = [
    "AtLeastOnce",
    "CommitEdge",
    "Delivery",
    "ExactlyOnce",
    "Publishing",
    "Sink",
    "build_delivery",
]


def build_delivery(
    settings: Settings,
    publisher: Publishing,
    edge: CommitEdge,
    metrics: Metrics,
    *,
    max_request_bytes: int,
) -> Delivery:
    """The delivery mode ``WORKER_DELIVERY`` names, over its own offset tracker."""
    offsets = OffsetTracker()
    if settings.delivery.delivery == "exactly_once" and settings.kafka.kafka_client == "confluent":
        # librdkafka's consumer gives its group metadata: one producer, fenced by the group.
        # Imported here: confluent-kafka is an extra, absent from the base install.
        from worker.delivery.exactly_once_group import GroupEdge, GroupFencedExactlyOnce

        return GroupFencedExactlyOnce(
            settings,
            offsets,
            cast(GroupEdge, edge),
            metrics,
            producer_config=rdkafka_config.producer_config(
                settings.kafka, settings.kafka_auth, max_request_bytes=max_request_bytes
            ),
        )
    if settings.delivery.delivery == "exactly_once":
        return ExactlyOnce(
            settings,
            offsets,
            edge,
            metrics,
            new_producer=functools.partial(
                transactional_producer,
                settings.kafka,
                client_kwargs=kafka_client_kwargs(settings.kafka_auth),
                max_request_bytes=max_request_bytes,
            ),
            owns=edge.owns,
        )
    return AtLeastOnce(
        publisher,
        offsets,
        edge,
        metrics,
        interval_s=settings.kafka.commit_interval_ms / 1000,
        max_uncommitted=settings.delivery.max_uncommitted_per_partition,
    )
