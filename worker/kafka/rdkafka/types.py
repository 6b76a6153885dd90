"""librdkafka's messages, partitions and errors in the edge's vocabulary (aiokafka's types).

The rest of the worker sees one record type, ``ConsumerRecord``, one partition type
and aiokafka's error classes whichever client runs: this module translates
confluent-kafka's ``Message``, ``TopicPartition`` and ``KafkaError`` into them.

Headers: librdkafka gives a header's value as None when it is null (as aiokafka
does); a key that is not UTF-8 is decoded with replacement characters rather than
stop the partition (``headers_of``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import confluent_kafka
from aiokafka import errors as aioerrors
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition

__all__ = [
    "committed_of",
    "from_rd_error",
    "headers_of",
    "record_of",
    "to_rd_offsets",
    "to_rd_partitions",
    "tp_of",
]

# librdkafka's timestamp types (1 create, 2 log append) → the protocol's (0, 1).
_TIMESTAMP_TYPES = {
    confluent_kafka.TIMESTAMP_CREATE_TIME: 0,
    confluent_kafka.TIMESTAMP_LOG_APPEND_TIME: 1,
}

_SIZE_CODES = {confluent_kafka.KafkaError.MSG_SIZE_TOO_LARGE}
_REBALANCE_CODES = {
    confluent_kafka.KafkaError.REBALANCE_IN_PROGRESS,
    confluent_kafka.KafkaError.ILLEGAL_GENERATION,
    confluent_kafka.KafkaError.UNKNOWN_MEMBER_ID,
    confluent_kafka.KafkaError._ASSIGNMENT_LOST,
    confluent_kafka.KafkaError.FENCED_MEMBER_EPOCH,
    confluent_kafka.KafkaError.STALE_MEMBER_EPOCH,
}


def headers_of(message: Any) -> list[tuple[str, bytes | None]]:
    """The message's headers, each key as text: one that is not UTF-8 is decoded with
    replacement characters (a header list the binding cannot decode at all is empty)."""
    try:
        headers = message.headers() or []
    except UnicodeDecodeError:
        return []
    return [
        (key if isinstance(key, str) else bytes(key).decode("utf-8", "replace"), value)
        for key, value in headers
    ]


def record_of(message: Any) -> ConsumerRecord[bytes, bytes]:
    """A librdkafka message (without error) as the record the worker handles."""
    kind, timestamp = message.timestamp()
    key, value = message.key(), message.value()
    return ConsumerRecord(
        topic=message.topic(),
        partition=message.partition(),
        offset=message.offset(),
        timestamp=timestamp if kind in _TIMESTAMP_TYPES else -1,
        timestamp_type=_TIMESTAMP_TYPES.get(kind, 0),
        key=key,
        value=value,
        checksum=None,
        serialized_key_size=-1 if key is None else len(key),
        serialized_value_size=-1 if value is None else len(value),
        headers=headers_of(message),
    )


def tp_of(partition: Any) -> TopicPartition:
    """A confluent ``TopicPartition`` as the edge's (topic and partition only)."""
    return TopicPartition(partition.topic, partition.partition)


def to_rd_partitions(partitions: Iterable[TopicPartition]) -> list[confluent_kafka.TopicPartition]:
    return [confluent_kafka.TopicPartition(tp.topic, tp.partition) for tp in partitions]


def to_rd_offsets(
    offsets: Mapping[TopicPartition, OffsetAndMetadata],
) -> list[confluent_kafka.TopicPartition]:
    """Offsets to commit, each with its metadata."""
    return [
        confluent_kafka.TopicPartition(tp.topic, tp.partition, meta.offset, metadata=meta.metadata)
        for tp, meta in offsets.items()
    ]


def committed_of(partitions: Iterable[Any]) -> dict[TopicPartition, OffsetAndMetadata]:
    """``Consumer.committed``'s answer: partitions without a commit (offset < 0) left out."""
    found: dict[TopicPartition, OffsetAndMetadata] = {}
    for partition in partitions:
        if partition.error is not None:
            raise from_rd_error(partition.error)
        if partition.offset >= 0:
            found[tp_of(partition)] = OffsetAndMetadata(partition.offset, partition.metadata or "")
    return found


def from_rd_error(error: Any, *, commit: bool = False) -> aioerrors.KafkaError:
    """A librdkafka error (``KafkaError`` or ``KafkaException``) as aiokafka's error class:
    a size refusal is MessageSizeTooLargeError, a commit refused for a rebalance is
    CommitFailedError, the rest KafkaError (which the callers retry or log)."""
    if isinstance(error, confluent_kafka.KafkaException):
        error = error.args[0]
    code = error.code() if isinstance(error, confluent_kafka.KafkaError) else None
    text = error.str() if isinstance(error, confluent_kafka.KafkaError) else str(error)
    if code in _SIZE_CODES:
        return aioerrors.MessageSizeTooLargeError(text)
    if commit or code in _REBALANCE_CODES:
        return aioerrors.CommitFailedError(text)
    return aioerrors.KafkaError(text)
