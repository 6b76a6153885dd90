"""librdkafka's log lines and errors become the worker's structured lines, a repeat once."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from confluent_kafka import KafkaError

from worker.kafka.rdkafka import log as rdkafka_log
from worker.kafka.rdkafka.log import RdLogger, Repeats, on_error
from worker.observability import configure_logging
from worker.observability.logging import reset_logging

pytestmark = pytest.mark.unit

REFUSED = (
    "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused "
    "(after {ms}ms in state CONNECT)"
)


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    """The worker's logging (JSON) into a buffer, reset afterwards."""
    stream = io.StringIO()
    configure_logging("json", "info", stream=stream)
    yield stream
    reset_logging()


def _records(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_log_line_is_json_with_facility_client_and_text(lines: io.StringIO) -> None:
    """The binding's log(level, "%s [%s] %s", facility, client, text) becomes one JSON line."""
    RdLogger(Repeats()).log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "x failed")
    [record] = _records(lines)
    assert record["event"] == "librdkafka_log" and record["logger"] == "librdkafka"
    assert (record["level"], record["facility"], record["client"]) == (
        "error",
        "FAIL",
        "rdkafka#producer-1",
    )
    assert record["detail"] == "x failed"


def test_a_repeated_text_is_logged_once_per_window_with_its_count(lines: io.StringIO) -> None:
    """The same refusal every few ms, as log line and as error: one line, then the count."""
    clock = Clock()
    repeats = Repeats(window_s=60.0, clock=clock)
    logger = RdLogger(repeats)
    error = KafkaError(KafkaError._TRANSPORT, REFUSED.format(ms=0))
    for ms in range(5):
        logger.log(logging.ERROR, "%s [%s] %s", "FAIL", "c", REFUSED.format(ms=ms))
        on_error(error, repeats)
    clock.now_s += 61.0
    on_error(error, repeats)
    first, second = _records(lines)
    assert first["detail"] == second["detail"] == REFUSED.split(" (after")[0]
    assert "repeated" not in first and second["repeated"] == 9
    assert (second["event"], second["code"], second["fatal"]) == (
        "kafka_client_error",
        "_TRANSPORT",
        False,
    )


def test_informational_lines_stay_below_the_library_level(lines: io.StringIO) -> None:
    """librdkafka's INFO lines (an idle connection closed) are kept out, as other libraries'."""
    RdLogger(Repeats()).log(
        logging.INFO, "%s [%s] %s", "FAIL", "c", "Disconnected (after 1ms in state UP)"
    )
    assert _records(lines) == []


def test_every_client_configuration_routes_both() -> None:
    """The consumer's and producers' configurations carry the logger and the error callback."""
    callbacks = rdkafka_log.callbacks()
    assert isinstance(callbacks["logger"], RdLogger) and callbacks["error_cb"] is on_error
