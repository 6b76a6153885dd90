"""When a record is done and what is committed: one ``Delivery`` per mode, chosen once.

``at_least_once``: done once the broker acknowledged the outcome; offsets committed
through the consumer. ``exactly_once``: outcomes and offsets in Kafka transactions,
through the transactional producers the Kafka edge built for the chosen client.
"""

from __future__ import annotations

from worker.delivery.at_least_once import AtLeastOnce
from worker.delivery.base import Delivery, Publishing, Sink
from worker.delivery.exactly_once import ExactlyOnce
from worker.delivery.offsets import OffsetTracker
from worker.kafka.transactions import Transactions
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
    ``transactions``: the Kafka edge's transactional producers (exactly_once)."""
    offsets = OffsetTracker()
    if settings.delivery.delivery == "exactly_once":
        return ExactlyOnce(settings, offsets, edge, metrics, transactions=transactions)
    return AtLeastOnce(
        publisher,
        offsets,
        edge,
        metrics,
        interval_s=settings.kafka.commit_interval_ms / 1000,
        max_uncommitted=settings.delivery.max_uncommitted_per_partition,
    )
