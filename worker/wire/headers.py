"""Kafka record headers: every header name of the wire contract, read and written in one place.

Also where a record's coordinates (``Source``) become headers, for results and for
dead letters, and the small formats those use (RFC 3339 times, truncated UTF-8).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from worker.errors import DecodeError, RetriesExhausted, WorkerError

__all__ = [
    "CONTENT_TYPE",
    "CONTENT_TYPE_BINARY",
    "CONTENT_TYPE_JSON",
    "CONTENT_TYPE_PROTOBUF",
    "DEAD_LETTER_HEADERS",
    "INFERENCE_HEADER_CONTENT_LENGTH",
    "MAX_ERROR_MESSAGE_BYTES",
    "TRACEPARENT",
    "TRACESTATE",
    "Headers",
    "Source",
    "check_header_keys",
    "dead_letter_headers",
    "header_text",
    "header_value",
    "merge_headers",
    "omitted_value_headers",
    "replay_count",
    "replay_headers",
    "rfc3339_utc",
    "sendable_key",
    "source_headers",
    "truncate_utf8",
]

#: Kafka record headers; a header's value may be null.
Headers = Sequence[tuple[str, bytes | None]]

CONTENT_TYPE: Final = "content-type"
INFERENCE_HEADER_CONTENT_LENGTH: Final = "inference-header-content-length"
X_MODEL_NAME: Final = "x-model-name"
X_MODEL_VERSION: Final = "x-model-version"
X_REQUEST_ID: Final = "x-request-id"
X_SOURCE_TOPIC: Final = "x-source-topic"
X_SOURCE_PARTITION: Final = "x-source-partition"
X_SOURCE_OFFSET: Final = "x-source-offset"
X_SOURCE_TIMESTAMP: Final = "x-source-timestamp"
X_ERROR_CODE: Final = "x-error-code"
X_ERROR_MESSAGE: Final = "x-error-message"
X_ERROR_RETRYABLE: Final = "x-error-retryable"
X_ATTEMPTS: Final = "x-attempts"
X_CONSUMER_GROUP: Final = "x-consumer-group"
X_FAILED_AT: Final = "x-failed-at"
#: A dead letter whose value (or key) the dead-letter topic refused for its size.
X_VALUE_OMITTED: Final = "x-value-omitted"
X_ORIGINAL_VALUE_BYTES: Final = "x-original-value-bytes"
X_ORIGINAL_VALUE_SHA256: Final = "x-original-value-sha256"
X_KEY_OMITTED: Final = "x-key-omitted"
X_ORIGINAL_KEY_BYTES: Final = "x-original-key-bytes"
X_ORIGINAL_KEY_SHA256: Final = "x-original-key-sha256"
#: Results of a decoupled model's request (WORKER_STREAM_OUTPUT): the place of a
#: response in its stream, whether it is the last, and how many carried outputs.
X_RESPONSE_INDEX: Final = "x-response-index"
X_RESPONSE_FINAL: Final = "x-response-final"
X_RESPONSE_COUNT: Final = "x-response-count"
#: Dead letters of a stream that failed midway: responses received, results published.
X_RESPONSES_RECEIVED: Final = "x-responses-received"
X_RESPONSES_PUBLISHED: Final = "x-responses-published"
#: Requests to a sequence model (WORKER_SEQUENCE_FROM_KEY): the sequence's first and last.
X_SEQUENCE_START: Final = "x-sequence-start"
X_SEQUENCE_END: Final = "x-sequence-end"

#: W3C Trace Context of the request: kept on its result, its dead letter and a replay.
TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"

#: A request re-produced from the dead-letter topic by ``replay``: which dead letter
#: (``dlq-topic/partition/offset``), and how many times its request has been replayed.
X_REPLAYED_FROM: Final = "x-replayed-from"
X_REPLAY_COUNT: Final = "x-replay-count"

#: Every header the worker adds to a dead letter (and every ``x-error-*``): a replay
#: removes them, so that the request goes back as its producer sent it.
DEAD_LETTER_HEADERS: Final = frozenset(
    {
        X_ERROR_CODE,
        X_ERROR_MESSAGE,
        X_ERROR_RETRYABLE,
        X_ATTEMPTS,
        X_SOURCE_TOPIC,
        X_SOURCE_PARTITION,
        X_SOURCE_OFFSET,
        X_SOURCE_TIMESTAMP,
        X_CONSUMER_GROUP,
        X_FAILED_AT,
        X_VALUE_OMITTED,
        X_ORIGINAL_VALUE_BYTES,
        X_ORIGINAL_VALUE_SHA256,
        X_KEY_OMITTED,
        X_ORIGINAL_KEY_BYTES,
        X_ORIGINAL_KEY_SHA256,
        X_RESPONSES_RECEIVED,
        X_RESPONSES_PUBLISHED,
    }
)
_ERROR_PREFIX: Final = "x-error-"

#: Kafka Connect's dead-letter context headers (its sink connectors'
#: ``errors.deadletterqueue.context.headers.enable``), written by WORKER_DLQ_HEADER_STYLE
#: ``connect`` or ``both`` so that tools made for Connect's dead letters read ours.
CONNECT_PREFIX: Final = "__connect.errors."
CONNECT_TOPIC: Final = "__connect.errors.topic"
CONNECT_PARTITION: Final = "__connect.errors.partition"
CONNECT_OFFSET: Final = "__connect.errors.offset"
CONNECT_CONNECTOR: Final = "__connect.errors.connector.name"
CONNECT_EXCEPTION_CLASS: Final = "__connect.errors.exception.class.name"
CONNECT_EXCEPTION_MESSAGE: Final = "__connect.errors.exception.message"
#: The module the exception class names of Connect-style dead letters are in.
CONNECT_CLASS_MODULE: Final = "worker.errors."

CONTENT_TYPE_JSON: Final = "application/json"
CONTENT_TYPE_BINARY: Final = "application/octet-stream"
CONTENT_TYPE_PROTOBUF: Final = "application/x-protobuf"
MAX_ERROR_MESSAGE_BYTES: Final = 1024


@dataclass(frozen=True, slots=True)
class Source:
    """Where a record came from: its coordinates in Kafka and its timestamp."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int = 0

    @classmethod
    def of(cls, record: Any) -> Source:
        """The coordinates of a consumed record (anything with topic, partition, offset)."""
        return cls(record.topic, record.partition, record.offset, record.timestamp)

    def __str__(self) -> str:
        return f"{self.topic}-{self.partition}@{self.offset}"


def header_value(headers: Headers, name: str) -> bytes | None:
    """Value of the last header called `name` (case-insensitive), or None."""
    wanted = name.lower()
    found: bytes | None = None
    for key, value in headers:
        if key.lower() == wanted:
            found = value
    return found


def header_text(headers: Headers, name: str) -> str | None:
    """The last ``name`` header as stripped UTF-8 text; DecodeError naming it if not UTF-8."""
    raw = header_value(headers, name)
    if raw is None:
        return None
    try:
        return bytes(raw).decode().strip()
    except UnicodeDecodeError:
        raise DecodeError(f"header {name}: value is not valid UTF-8") from None


def check_header_keys(headers: Headers) -> None:
    """DecodeError naming the first header key that is not UTF-8.

    Kafka's header keys are strings, yet the protocol carries bytes. Both Kafka edges hand
    such a key over decoded with ``surrogateescape`` (aiokafka's ``TolerantRecords``;
    on librdkafka it is the only header the record then has: confluent-kafka reads none),
    and only such a key holds characters that no valid UTF-8 decodes to.
    """
    for name, _ in headers:
        if name.isascii():
            continue
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raw = name.encode("utf-8", "surrogateescape")
            raise DecodeError(
                f"header key {raw!r} is not valid UTF-8: Kafka header keys are strings, "
                "have the producer write its header keys as UTF-8"
            ) from None


def sendable_key(name: str) -> str:
    """A header key a producer can write: one that is not UTF-8 (``check_header_keys``)
    gets U+FFFD for each byte that is not."""
    if name.isascii():
        return name
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def merge_headers(
    original: Headers, added: list[tuple[str, bytes]], also_drop: frozenset[str] = frozenset()
) -> list[tuple[str, bytes | None]]:
    """The original headers, then ``added``, which replace the originals of the same names."""
    # The worker's value wins: originals of the same name are dropped, not duplicated.
    # Null values and repeated names among the others pass through as they came.
    replaced = {name for name, _ in added} | also_drop
    kept: list[tuple[str, bytes | None]] = [
        (sendable_key(name), None if value is None else bytes(value))
        for name, value in original
        if name.lower() not in replaced
    ]
    return [*kept, *added]


def truncate_utf8(text: str, max_bytes: int = MAX_ERROR_MESSAGE_BYTES) -> bytes:
    """UTF-8 of `text`, cut to at most `max_bytes` on a character boundary, marked '...'."""
    encoded = text.encode("utf-8", errors="replace")
    if len(encoded) <= max_bytes:
        return encoded
    marker = b"..."
    head = encoded[: max_bytes - len(marker)].decode("utf-8", errors="ignore")
    return head.encode() + marker


def rfc3339_utc(moment: datetime) -> str:
    """`moment` as RFC 3339 UTC with milliseconds, e.g. 2024-05-01T12:00:00.000Z."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def dead_letter_headers(
    original_headers: Headers,
    error: WorkerError,
    source: Source,
    *,
    attempts: int,
    group_id: str,
    failed_at: datetime,
    style: str = "worker",
) -> list[tuple[str, bytes | None]]:
    """Headers of a dead letter: the original ones first, then the explanation, in the
    worker's ``x-*`` headers, Kafka Connect's ``__connect.errors.*`` or both (``style``).

    A retryable error is reported as RETRIES_EXHAUSTED naming it, so that
    x-error-code is always one of the dead-letter codes. x-error-retryable
    tells whether the cause was transient, i.e. whether replaying the record
    later may succeed: true exactly for RETRIES_EXHAUSTED. The error's facts
    (e.g. x-responses-received) follow.
    """
    if error.retryable:
        error = RetriesExhausted.after(error, attempts)
    transient = isinstance(error, RetriesExhausted)
    added = [
        (X_ERROR_CODE, error.code.encode()),
        (X_ERROR_MESSAGE, truncate_utf8(error.message)),
        (X_ERROR_RETRYABLE, b"true" if transient else b"false"),
        (X_ATTEMPTS, str(attempts).encode()),
        *source_headers(source),
        (X_SOURCE_TIMESTAMP, str(source.timestamp_ms).encode()),
        (X_CONSUMER_GROUP, group_id.encode()),
        (X_FAILED_AT, rfc3339_utc(failed_at).encode()),
        *error.facts,
    ]
    if style != "worker":
        connect = [
            (CONNECT_TOPIC, source.topic.encode()),
            (CONNECT_PARTITION, str(source.partition).encode()),
            (CONNECT_OFFSET, str(source.offset).encode()),
            (CONNECT_CONNECTOR, group_id.encode()),
            (CONNECT_EXCEPTION_CLASS, f"{CONNECT_CLASS_MODULE}{type(error).__name__}".encode()),
            (CONNECT_EXCEPTION_MESSAGE, truncate_utf8(error.message)),
        ]
        added = connect if style == "connect" else [*added, *connect]
    return merge_headers(original_headers, added)


def source_headers(source: Source) -> list[tuple[str, bytes]]:
    """``x-source-topic``, ``-partition`` and ``-offset`` of a record."""
    return [
        (X_SOURCE_TOPIC, source.topic.encode()),
        (X_SOURCE_PARTITION, str(source.partition).encode()),
        (X_SOURCE_OFFSET, str(source.offset).encode()),
    ]


def omitted_value_headers(
    headers: Headers, value: bytes | None, key: bytes | None, *, drop_key: bool
) -> list[tuple[str, bytes | None]]:
    """A dead letter's headers once its value (and key) are left out: sizes and digests.

    Headers that already say the value was left out (a dead letter slimmed before, now
    losing its key too) keep describing the original value, not the empty one.
    """
    added: list[tuple[str, bytes | None]] = []
    if not any(name == X_VALUE_OMITTED for name, _ in headers):
        added += [
            (X_VALUE_OMITTED, b"true"),
            (X_ORIGINAL_VALUE_BYTES, str(len(value or b"")).encode()),
            (X_ORIGINAL_VALUE_SHA256, hashlib.sha256(value or b"").hexdigest().encode()),
        ]
    if drop_key:
        added += [
            (X_KEY_OMITTED, b"true"),
            (X_ORIGINAL_KEY_BYTES, str(len(key or b"")).encode()),
            (X_ORIGINAL_KEY_SHA256, hashlib.sha256(key or b"").hexdigest().encode()),
        ]
    return [*headers, *added]


def replay_count(headers: Headers) -> int:
    """How many times this record's request has been replayed (``x-replay-count``; 0 if
    absent or not a count)."""
    raw = header_value(headers, X_REPLAY_COUNT)
    text = bytes(raw).decode("ascii", errors="replace").strip() if raw is not None else ""
    return int(text) if text.isdigit() else 0


def replay_headers(
    headers: Headers, replayed_from: str, count: int
) -> list[tuple[str, bytes | None]]:
    """A dead letter's headers as its replay carries them.

    The request's own headers, in order (null values and repeated names as they
    came), without those the worker added to the dead letter or an earlier replay
    set; then ``x-replayed-from`` (``dlq-topic/partition/offset``) and ``x-replay-count``.
    """
    ours = DEAD_LETTER_HEADERS | {X_REPLAYED_FROM, X_REPLAY_COUNT}
    kept: list[tuple[str, bytes | None]] = [
        (sendable_key(name), None if value is None else bytes(value))
        for name, value in headers
        if name.lower() not in ours and not name.lower().startswith((_ERROR_PREFIX, CONNECT_PREFIX))
    ]
    return [*kept, (X_REPLAYED_FROM, replayed_from.encode()), (X_REPLAY_COUNT, str(count).encode())]
