"""Dead-letter headers: complete, after the originals, bounded, always a dead-letter code."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from worker import wire
from worker.errors import (
    DecodeError,
    InvalidRequest,
    RetriesExhausted,
    TritonUnavailable,
)


def test_dead_letter_headers_complete_and_after_originals() -> None:
    """Original headers come first; every dead-letter header follows with its value."""
    original = [("trace", b"1"), ("x-error-code", b"STALE"), ("content-type", b"application/json")]
    failed_at = datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=timezone(timedelta(hours=2)))
    built = wire.dead_letter_headers(
        original,
        RetriesExhausted.after(TritonUnavailable("stream broke"), 4),
        attempts=4,
        source=wire.Source("requests", 3, 42, 1714557600000),
        group_id="workers",
        failed_at=failed_at,
    )
    assert built[:2] == [("trace", b"1"), ("content-type", b"application/json")]
    assert dict(built[2:]) == {
        "x-error-code": b"RETRIES_EXHAUSTED",
        "x-error-message": b"gave up after 4 attempts; last error TRITON_UNAVAILABLE: stream broke",
        "x-error-retryable": b"true",
        "x-attempts": b"4",
        "x-source-topic": b"requests",
        "x-source-partition": b"3",
        "x-source-offset": b"42",
        "x-source-timestamp": b"1714557600000",
        "x-consumer-group": b"workers",
        "x-failed-at": b"2024-05-01T10:00:00.123Z",
    }


def test_dead_letter_message_truncated_on_utf8_boundary() -> None:
    """A long multi-byte message is cut to at most 1 KiB of valid UTF-8 ending in '...'."""
    built = wire.dead_letter_headers(
        [],
        InvalidRequest("é" * 1000),
        attempts=0,
        source=wire.Source("t", 0, 0, 0),
        group_id="g",
        failed_at=datetime(2024, 1, 1, tzinfo=UTC),
    )
    assert dict(built)["x-error-retryable"] == b"false"
    message = dict(built)["x-error-message"]
    assert message is not None
    assert len(message) <= 1024
    text = message.decode("utf-8")
    assert text.endswith("...")
    assert set(text[:-3]) == {"é"}
    assert len(text) - 3 == 510


def test_retryable_error_in_a_dead_letter_becomes_retries_exhausted() -> None:
    """x-error-code is always a dead-letter code, even if a retryable error arrives."""
    built = wire.dead_letter_headers(
        [],
        TritonUnavailable("connection refused"),
        attempts=2,
        source=wire.Source("t", 0, 0, 0),
        group_id="g",
        failed_at=datetime(2024, 1, 1, tzinfo=UTC),
    )
    headers = dict(built)
    assert headers["x-error-code"] == b"RETRIES_EXHAUSTED"
    assert headers["x-error-retryable"] == b"true"
    assert headers["x-error-message"] == (
        b"gave up after 2 attempts; last error TRITON_UNAVAILABLE: connection refused"
    )


CONNECT = {
    "__connect.errors.topic": b"requests",
    "__connect.errors.partition": b"3",
    "__connect.errors.offset": b"42",
    "__connect.errors.connector.name": b"workers",
    "__connect.errors.exception.class.name": b"worker.errors.InvalidRequest",
    "__connect.errors.exception.message": b"inputs[0]: wrong",
}


def _styled(style: str) -> list[tuple[str, bytes | None]]:
    return wire.dead_letter_headers(
        [("trace", b"1")],
        InvalidRequest("inputs[0]: wrong"),
        wire.Source("requests", 3, 42, 1714557600000),
        attempts=0,
        group_id="workers",
        failed_at=datetime(2024, 1, 1, tzinfo=UTC),
        style=style,
    )


def test_connect_style_dead_letters_carry_kafka_connect_s_headers_instead() -> None:
    """WORKER_DLQ_HEADER_STYLE=connect: Connect's context headers, none of the worker's."""
    built = _styled("connect")
    assert built[0] == ("trace", b"1")
    assert dict(built[1:]) == CONNECT


def test_both_styles_carry_the_worker_s_headers_then_connect_s() -> None:
    built = dict(_styled("both"))
    assert built["x-error-code"] == b"INVALID_REQUEST"
    assert built["x-source-offset"] == b"42"
    assert {name: built[name] for name in CONNECT} == CONNECT
    assert [name for name, _ in _styled("worker") if name.startswith("__connect")] == []


def test_a_replay_leaves_out_the_connect_headers_too() -> None:
    replayed = wire.replay_headers(_styled("both"), "dlq/0/7", 1)
    assert replayed == [("trace", b"1"), ("x-replayed-from", b"dlq/0/7"), ("x-replay-count", b"1")]


def test_a_header_key_that_is_not_utf8_is_a_decode_error_naming_it() -> None:
    """A key holding escaped bytes (as both Kafka edges hand one over) is refused, named by
    its bytes; keys in any script that are UTF-8 pass."""
    wire.check_header_keys([("content-type", b"x"), ("ключ", None), ("鍵", b"")])
    with pytest.raises(DecodeError, match=r"header key b'x-\\xff\\xfe' is not valid UTF-8"):
        wire.check_header_keys([("ok", b"1"), ("x-\udcff\udcfe", b"odd")])


def test_dead_letters_and_replays_write_such_a_key_with_replacement_characters() -> None:
    """The key a producer cannot write is written with U+FFFD per byte that is not UTF-8;
    its value and the other headers are kept."""
    built = wire.dead_letter_headers(
        [("x-\udcff", b"odd"), ("ключ", b"1")],
        InvalidRequest("no"),
        attempts=1,
        source=wire.Source("requests", 0, 1, 0),
        group_id="workers",
        failed_at=datetime(2024, 5, 1, tzinfo=UTC),
    )
    assert built[:2] == [("x-\ufffd", b"odd"), ("ключ", b"1")]
    replayed = wire.replay_headers([("x-\udcff", None)], "dlq/0/1", 1)
    assert replayed[0] == ("x-\ufffd", None)
