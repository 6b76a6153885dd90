"""The aiokafka clients the worker and its commands build, each with the worker's Kafka settings.

Bootstrap servers, client id, TLS and SASL options (``worker.kafka.options``), and for a
producer linger and compression: applied here alone, whoever builds the client (the
edge, ``produce``, ``tail``, ``topics``, ``replay``). Each caller adds what is its own
(a group, acks, sizes, a transactional id) as keyword options. ``security`` is
``kafka_client_kwargs(auth)``, computed once by the caller (it reads files).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from worker.kafka.aiokafka._compat import read_header_keys_tolerantly
from worker.kafka.publisher import kafka_compression
from worker.settings import KafkaSettings

__all__ = [
    "AIOKafkaAdminClient",
    "AIOKafkaConsumer",
    "AIOKafkaProducer",
    "admin",
    "consumer",
    "create_topics",
    "idempotent",
    "producer",
]

#: Producer batch per partition. aiokafka's 16 KiB default fills after ~40 results;
#: senders then queue behind the in-flight batch, which costs CPU per record.
_MAX_BATCH_BYTES = 512 * 1024


def _common(
    kafka: KafkaSettings, security: Mapping[str, Any], suffix: str | None
) -> dict[str, Any]:
    """Every client's options: where Kafka is, who asks (``<client id>-<suffix>``), TLS, SASL."""
    client_id = kafka.client_id if suffix is None else f"{kafka.client_id}-{suffix}"
    return {"bootstrap_servers": kafka.bootstrap_servers, "client_id": client_id, **security}


def producer(
    kafka: KafkaSettings,
    security: Mapping[str, Any],
    *,
    suffix: str | None = None,
    **options: Any,
) -> AIOKafkaProducer:
    """A producer (not started) with the worker's settings, linger and compression included;
    ``options`` add the caller's own (see ``idempotent``)."""
    return AIOKafkaProducer(
        **_common(kafka, security, suffix),
        linger_ms=kafka.linger_ms,
        compression_type=kafka_compression(kafka.compression_type),
        **options,
    )


def idempotent(max_request_bytes: int, *, batched: bool = True) -> dict[str, Any]:
    """The options of an idempotent producer (``acks=all``) of records up to
    ``max_request_bytes``; ``batched``: batches per partition of up to 512 KiB."""
    options: dict[str, Any] = {
        "acks": "all",
        "enable_idempotence": True,
        "max_request_size": max_request_bytes,
    }
    if batched:
        options["max_batch_size"] = min(_MAX_BATCH_BYTES, max_request_bytes)
    return options


def consumer(
    kafka: KafkaSettings,
    security: Mapping[str, Any],
    *,
    suffix: str | None = None,
    **options: Any,
) -> AIOKafkaConsumer:
    """A consumer (not started) with the worker's settings; ``options`` add the caller's own
    (its group or none, isolation level, where to start). Header keys that are not UTF-8
    are read, not refused (``_compat.read_header_keys_tolerantly``)."""
    read_header_keys_tolerantly()
    return AIOKafkaConsumer(**_common(kafka, security, suffix), **options)


def admin(
    kafka: KafkaSettings, security: Mapping[str, Any], *, suffix: str | None = None
) -> AIOKafkaAdminClient:
    """An admin client (not started) with the worker's settings."""
    return AIOKafkaAdminClient(**_common(kafka, security, suffix))


async def create_topics(
    client: AIOKafkaAdminClient, names: Sequence[str], *, partitions: int, replication: int
) -> list[tuple[Any, ...]]:
    """Create the topics ``names`` through a started admin client; the broker's answer for
    each: (topic, error code, error message), code 0 when created."""
    response = await client.create_topics(
        [NewTopic(name, partitions, replication) for name in names]
    )
    return list(response.topic_errors)
