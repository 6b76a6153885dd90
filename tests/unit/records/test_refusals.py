"""The output topic's size refusals remembered: the smallest refused lately is a ceiling,
in the bytes of the whole record (key, value, headers) as the broker measures it."""

from __future__ import annotations

import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from tests.unit.records.fakes import Clock
from worker.records.refusals import OutputRefusals, record_bytes

pytestmark = pytest.mark.timeout(10)

HEADERS = [("content-type", b"application/json"), ("x-request-id", b"r1"), ("trace", None)]


def result(value_bytes: int) -> tuple[bytes, bytes, list[tuple[str, bytes | None]]]:
    """A result record's key, value and headers, its value ``value_bytes`` long."""
    return b"key-1", b"v" * value_bytes, HEADERS


def test_no_refusal_no_ceiling() -> None:
    assert OutputRefusals(clock=Clock()).ceiling() is None


@pytest.mark.parametrize(
    ("key", "value", "headers"),
    [
        (None, b"", []),
        (b"k", b"v" * 100, HEADERS),
        (b"k" * 599_800, b"v" * 139, HEADERS),
        (b"k" * 20, b"v" * 70_000, [("h" * 200, b"x" * 20_000), ("\u00e9t\u00e9", b"")]),
    ],
)
def test_record_bytes_is_the_size_of_a_batch_of_that_record_alone(
    key: bytes | None, value: bytes, headers: list[tuple[str, bytes | None]]
) -> None:
    """record_bytes: the length of a v2 record batch holding only that record, as a producer
    builds it (what the broker compares with max.message.bytes)."""
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=False,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1 << 21,
    )
    builder.append(0, timestamp=1_700_000_000_000, key=key, value=value, headers=headers)
    assert record_bytes(key, value, headers) == len(builder.build())


def test_the_smallest_refused_record_is_the_ceiling() -> None:
    """Refused 90,000 then 70,000 then 80,000 bytes of value: results as large as the
    70,000 one, key and headers included, or larger wait."""
    refusals = OutputRefusals(clock=Clock())
    for size in (90_000, 70_000, 80_000):
        refusals.refused(*result(size))
    assert refusals.ceiling() == record_bytes(*result(70_000))


def test_a_record_mostly_key_and_headers_teaches_no_ceiling() -> None:
    """A refused result whose key (or headers) is most of it: its request's size, not its
    model's; no ceiling, and an earlier ceiling neither lowered nor kept longer."""
    clock = Clock()
    refusals = OutputRefusals(remember_s=60, clock=clock)
    refusals.refused(b"k" * 599_800, b"v" * 139, HEADERS)
    refusals.refused(None, b"v" * 139, [("big", b"h" * 599_800)])
    assert refusals.ceiling() is None
    refusals.refused(*result(70_000))
    clock.now += 50
    refusals.refused(b"k" * 40_000, b"v" * 30_000, HEADERS)
    assert refusals.ceiling() == record_bytes(*result(70_000))
    clock.now += 11
    assert refusals.ceiling() is None


def test_the_ceiling_is_forgotten_after_the_last_refusal() -> None:
    """Each refusal keeps the ceiling for remember_s more; then any size is tried again
    (the topic's limit may have been raised)."""
    clock = Clock()
    refusals = OutputRefusals(remember_s=60, clock=clock)
    refusals.refused(*result(70_000))
    clock.now += 50
    refusals.refused(*result(75_000))
    clock.now += 50  # 100 s after the first refusal, 50 s after the last
    assert refusals.ceiling() == record_bytes(*result(70_000))
    clock.now += 11
    assert refusals.ceiling() is None
    refusals.refused(*result(90_000))
    assert refusals.ceiling() == record_bytes(*result(90_000))
