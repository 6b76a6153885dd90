"""librdkafka's messages as the worker's records."""

from __future__ import annotations

import confluent_kafka
import pytest
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from worker.kafka.rdkafka.types import committed_of, headers_of, record_of


def test_a_message_becomes_the_same_record_aiokafka_gives() -> None:
    """Topic, partition, offset, key, value, null header values and sizes carry over."""
    message = confluent_kafka.Message(
        topic="t",
        partition=3,
        offset=41,
        key=b"k",
        value=b"value",
        headers=[("x-null", None), ("x-a", b"1")],
        timestamp=(confluent_kafka.TIMESTAMP_CREATE_TIME, 1700),
    )
    record = record_of(message)
    assert (record.topic, record.partition, record.offset) == ("t", 3, 41)
    assert (record.key, record.value) == (b"k", b"value")
    assert record.headers == [("x-null", None), ("x-a", b"1")]
    assert (record.timestamp, record.timestamp_type) == (1700, 0)
    assert (record.serialized_key_size, record.serialized_value_size) == (1, 5)


def test_null_key_value_and_no_headers() -> None:
    """A record with neither key, value nor headers has sizes -1 and an empty header list."""
    record = record_of(confluent_kafka.Message(topic="t", partition=0, offset=0))
    assert (record.key, record.value, record.headers) == (None, None, [])
    assert (record.serialized_key_size, record.serialized_value_size) == (-1, -1)


class _UndecodableHeaders:
    """A message whose header list confluent-kafka cannot build: its ``headers()`` fails
    as the binding's does on a key that is not UTF-8 (seen with confluent-kafka 2.16)."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def headers(self) -> list[tuple[str, bytes | None]]:
        try:
            self._key.decode()
        except UnicodeDecodeError as exc:
            raise SystemError("<method 'headers'> returned a result with an exception set") from exc
        raise AssertionError("the key decodes")


def test_a_header_key_that_is_not_utf8_is_the_only_header_left() -> None:
    """No header of the message can be read: the key that failed, decoded with
    surrogateescape, without a value (which dead-letters the record)."""
    assert headers_of(_UndecodableHeaders(b"x-\xff\xfe")) == [("x-\udcff\udcfe", None)]


def test_other_errors_of_the_binding_are_not_hidden() -> None:
    """A SystemError that no UnicodeDecodeError caused is raised as it came."""

    class Broken:
        def headers(self) -> None:
            raise SystemError("something else")

    with pytest.raises(SystemError, match="something else"):
        headers_of(Broken())


class _ReadPastItsEnd:
    """A committed offset whose metadata the binding read past its end into bytes that are
    not UTF-8: its ``metadata`` attribute raises, as the binding's does."""

    topic, partition, offset, error = "t", 0, 5, None

    @property
    def metadata(self) -> str:
        return b"d1:1+7fffffffffffffff\xff".decode()


def test_committed_metadata_that_does_not_decode_is_read_with_replacement() -> None:
    """The UnicodeDecodeError never escapes: the text as read, the bad byte U+FFFD (foreign
    to the worker's metadata, which the reader then ignores)."""
    found = committed_of([_ReadPastItsEnd()])
    assert found == {TopicPartition("t", 0): OffsetAndMetadata(5, "d1:1+7fffffffffffffff\ufffd")}
    none = confluent_kafka.TopicPartition("t", 1, 7)
    assert committed_of([none]) == {TopicPartition("t", 1): OffsetAndMetadata(7, "")}
