"""librdkafka's messages as the worker's records."""

from __future__ import annotations

import confluent_kafka

from worker.kafka.rdkafka.types import headers_of, record_of


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


def test_header_keys_that_are_not_utf8_are_decoded_with_replacement() -> None:
    """librdkafka may hand a header key over as bytes: it becomes text with U+FFFD."""
    # The stubs say header keys are str; librdkafka's are bytes when they are not UTF-8.
    bytes_key = [(b"x-\xff", b"v"), ("ok", b"w")]
    message = confluent_kafka.Message(topic="t", headers=bytes_key)  # type: ignore[arg-type]
    assert headers_of(message) == [("x-\ufffd", b"v"), ("ok", b"w")]
