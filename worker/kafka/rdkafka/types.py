"""librdkafka's messages, partitions and errors in the edge's vocabulary (aiokafka's types).

The rest of the worker sees one record type, ``ConsumerRecord``, one partition type
and aiokafka's error classes whichever client runs: this module translates
confluent-kafka's ``Message``, ``TopicPartition`` and ``KafkaError`` into them.

Headers: librdkafka gives a header's value as None when it is null (as aiokafka
does). A header key that is not UTF-8 makes confluent-kafka's ``Message.headers`` fail
(``headers_of``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

import confluent_kafka
from aiokafka import errors as aioerrors
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition

__all__ = [
    "committed_of",
    "from_rd_error",
    "headers_of",
    "metadata_of",
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
    """The message's headers, each key as text.

    confluent-kafka decodes header keys strictly, and fails the whole list on a key that
    is not UTF-8 (a SystemError whose cause is the UnicodeDecodeError; it leaves the
    message's cached header list half-built, so it is never asked again). No header of
    such a message can be read: it gets the one key that failed, decoded with
    ``surrogateescape`` and without a value, which dead-letters the record as aiokafka's
    ``TolerantRecords`` does (``worker.wire.headers.check_header_keys``).
    """
    try:
        headers = _headers(message) or []
    except (SystemError, UnicodeDecodeError) as exc:
        undecodable = _undecodable(exc)
        if undecodable is None:
            raise
        return [(undecodable.decode("utf-8", "surrogateescape"), None)]
    return list(headers)


#: ``Message.headers`` called through C: the binding returns the half-built list with the
#: UnicodeDecodeError still set, which the generic call path turns into the SystemError at
#: once. Called from Python bytecode, the call site, once specialised (after a few calls),
#: skips that check: the list came back and the error surfaced at some later call.
_headers = operator.methodcaller("headers")


def _undecodable(exc: BaseException) -> bytes | None:
    """The bytes a UnicodeDecodeError (``exc``, or what caused it) failed on."""
    for error in (exc, exc.__cause__, exc.__context__):
        if isinstance(error, UnicodeDecodeError):
            return bytes(error.object)
    return None


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
    """``Consumer.committed``'s answer: partitions without a commit (offset < 0) left out,
    each one's metadata as ``metadata_of`` reads it."""
    found: dict[TopicPartition, OffsetAndMetadata] = {}
    for partition in partitions:
        if partition.error is not None:
            raise from_rd_error(partition.error)
        if partition.offset >= 0:
            found[tp_of(partition)] = OffsetAndMetadata(partition.offset, metadata_of(partition))
    return found


def metadata_of(partition: Any) -> str:
    """A committed offset's metadata as confluent-kafka gives it, never raising.

    The binding copies librdkafka's metadata as a C string, up to the first NUL. It
    writes one after what it commits itself, but metadata another client committed has
    none, and the copy goes on past its end into whatever bytes follow in memory (seen:
    a 21-character metadata read as 22 bytes, the last 0xff). Those bytes fail the
    binding's UTF-8 decode (UnicodeDecodeError), or decode and come out appended: the
    text is given as read, undecodable bytes replaced, and it is for the reader to
    accept only what it wrote exactly (``worker.delivery.metadata``).
    """
    try:
        return str(partition.metadata or "")
    except UnicodeDecodeError as exc:
        return bytes(exc.object).decode("utf-8", "replace")


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
