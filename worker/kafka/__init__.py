"""The Kafka edge: the consumer and its fetch loop in, the producer out, client options."""

from worker.kafka.aiokafka.intake import Intake
from worker.kafka.feed import Dispatch, Rebalance
from worker.kafka.options import kafka_client_kwargs
from worker.kafka.publisher import PRODUCER_HEADROOM_BYTES, Publisher

__all__ = [
    "PRODUCER_HEADROOM_BYTES",
    "Dispatch",
    "Intake",
    "Publisher",
    "Rebalance",
    "kafka_client_kwargs",
]
