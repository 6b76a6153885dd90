"""What a replay reads off a dead letter and the headers it sends back."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import numpy as np
import pytest

from devtools.samples import Encoding, double_inputs, encode_request
from worker import wire
from worker.errors import Forbidden
from worker.wire import Headers, replay_count, replay_headers, request_names
from worker.wire.headers import DEAD_LETTER_HEADERS, omitted_value_headers
from worker.wire.messages import DeadLetterHeaders

_FAILED_AT = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def _dead_letter(original: Headers) -> list[tuple[str, bytes | None]]:
    return wire.dead_letter_headers(
        original,
        Forbidden("topic 'requests' may not use model 'double'"),
        wire.Source("requests", 2, 40, 1714557600000),
        attempts=1,
        group_id="workers",
        failed_at=_FAILED_AT,
    )


def test_replay_headers_are_the_requests_own_plus_the_replay_pair() -> None:
    """Every header the worker added goes; the producer's stay in order, nulls and repeats too."""
    original: Headers = [
        ("content-type", b"application/json"),
        ("trace", b"a"),
        ("empty", None),
        ("trace", b"b"),
        ("x-request-id", b"r-1"),
        ("x-model-name", b"double"),
    ]
    headers = _dead_letter(original)

    replayed = replay_headers(headers, "dlq/0/7", 1)

    assert replayed == [*original, ("x-replayed-from", b"dlq/0/7"), ("x-replay-count", b"1")]


def test_replay_headers_drop_omitted_value_headers_and_an_earlier_replays_pair() -> None:
    """A dead letter of a replay, written without its value: the count is replaced, not added."""
    first = replay_headers(_dead_letter([("trace", b"a")]), "dlq/0/7", 1)
    again = omitted_value_headers(_dead_letter(first), b"{}", b"key", drop_key=True)
    # As a decoupled model's stream that failed midway writes them too.
    again += [("x-responses-received", b"3"), ("x-responses-published", b"1")]
    assert {name for name, _ in again} >= DEAD_LETTER_HEADERS

    replayed = replay_headers(again, "dlq/1/9", 2)

    assert replayed == [("trace", b"a"), ("x-replayed-from", b"dlq/1/9"), ("x-replay-count", b"2")]


def test_replay_headers_drop_every_x_error_header_whatever_its_case() -> None:
    """x-error-* of any name and case are the worker's, never the producer's."""
    headers: Headers = [("X-Error-Code", b"OLD"), ("x-error-detail", b"?"), ("keep", b"1")]
    assert replay_headers(headers, "d/0/0", 1) == [
        ("keep", b"1"),
        ("x-replayed-from", b"d/0/0"),
        ("x-replay-count", b"1"),
    ]


@pytest.mark.parametrize(
    ("value", "count"),
    [(None, 0), (b"2", 2), (b" 3 ", 3), (b"-1", 0), (b"two", 0), (b"\xff", 0), (b"\xd9\xa3", 0)],
)
def test_replay_count(value: bytes | None, count: int) -> None:
    """x-replay-count as a count; absent or not a count is 0."""
    headers: Headers = [] if value is None else [("x-replay-count", value)]
    assert replay_count(headers) == count


@pytest.mark.parametrize("encoding", ["json", "binary", "protobuf"])
def test_request_names_in_every_encoding(encoding: Encoding) -> None:
    """The body's model and id are read in each encoding, as the worker reads them."""
    rng = np.random.default_rng(1)
    value, headers = encode_request("double", double_inputs(rng), encoding, "req-9")
    assert request_names(value, headers) == ("double", "req-9")


def test_request_names_headers_and_precedence() -> None:
    """The x-model-name header wins over the body's model; the body's id over x-request-id."""
    value = b'{"id": "body-id", "model_name": "mlp", "inputs": []}'
    headers: Headers = [("x-model-name", b"double"), ("x-request-id", b"header-id")]
    assert request_names(value, headers) == ("double", "body-id")
    assert request_names(b'{"inputs": []}', headers) == ("double", "header-id")


@pytest.mark.parametrize(
    ("value", "headers"),
    [
        (b'{"inputs": [', [("content-type", b"application/json")]),
        (b"\xff\xff\xff\x0f\x01garbage", [("content-type", b"application/x-protobuf")]),
        (b"{}", [("content-type", b"application/octet-stream")]),
        (b'{"id": 7}', []),
        (b"{}", [("content-type", b"text/plain")]),
        (None, []),
        (b"", [("x-model-name", b"\xff")]),
    ],
)
def test_request_names_of_undecodable_records_are_empty(
    value: bytes | None, headers: Headers
) -> None:
    """Records that do not decode name nothing, and reading them never raises."""
    assert request_names(value, headers) == ("", "")


def test_the_headers_a_replay_removes_are_the_dead_letter_schemas() -> None:
    """Every header of the dead-letter contract (schemas/) is one a replay removes."""
    documented = {field.encode_name for field in msgspec.structs.fields(DeadLetterHeaders)}
    assert documented == DEAD_LETTER_HEADERS
