"""When a record is done and what is committed: one ``Delivery`` per mode, chosen once.

``at_least_once``: done once the broker acknowledged the outcome; offsets committed
through the consumer. ``exactly_once``: outcomes and offsets in one Kafka
transaction per input partition (aiokafka), or in one transaction for every
partition, fenced by the group generation (librdkafka).
"""

from __future__ import annotations

from typing import cast

from worker.delivery.at_least_once import AtLeastOnce
from worker.delivery.base import Delivery, Publishing, Sink
from worker.delivery.exactly_once import ExactlyOnce
from worker.delivery.exactly_once_group import GroupEdge, GroupFencedExactlyOnce
from worker.delivery.offsets import OffsetTracker
from worker.kafka.edge import GroupFenced, Transactions
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
    transactions: Transactions,
) -> Delivery:
    """The delivery mode ``WORKER_DELIVERY`` names, over its own offset tracker;
    ``transactions`` (the Kafka edge's) say how exactly_once is fenced."""
    offsets = OffsetTracker()
    if settings.delivery.delivery == "exactly_once":
        if isinstance(transactions, GroupFenced):
            # librdkafka's consumer gives its group metadata: one producer, fenced by the group.
            return GroupFencedExactlyOnce(
                settings, offsets, cast(GroupEdge, edge), metrics, transactions=transactions
            )
        return ExactlyOnce(
            settings,
            offsets,
            edge,
            metrics,
            new_producer=transactions.new_producer,
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
