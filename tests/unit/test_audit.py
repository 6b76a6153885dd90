"""The audit record: its shape, digests instead of content, and where it goes per WORKER_AUDIT."""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
import structlog
from aiokafka.errors import KafkaTimeoutError
from aiokafka.structs import ConsumerRecord

from worker.audit import AUDIT_LOGGER, Audit, AuditEntry, AuditWriteFailed, audit_record
from worker.observability import configure_logging, reset_logging
from worker.settings import Settings, load_settings

PAYLOAD = b'{"inputs": [{"name": "secret-input", "data": [42]}]}'
KEY = b"customer-1234"


def _record(value: bytes | None = PAYLOAD, key: bytes | None = KEY) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        topic="requests",
        partition=3,
        offset=17,
        timestamp=1_700_000_000_000,
        timestamp_type=0,
        key=key,
        value=value,
        checksum=None,
        serialized_key_size=len(key or b""),
        serialized_value_size=len(value or b""),
        headers=(),
    )


def _settings(**extra: str) -> Settings:
    env = {
        "WORKER_INPUT_TOPICS": "requests",
        "WORKER_OUTPUT_TOPIC": "results",
        "WORKER_DLQ_TOPIC": "dead",
        "WORKER_CLIENT_ID": "worker-a",
    }
    env.update({f"WORKER_{k.upper()}": v for k, v in extra.items()})
    return load_settings(env)


class _Sends:
    """Collects what the audit sends; fails the first ``failures`` sends."""

    def __init__(self, failures: int = 0) -> None:
        self.sent: list[tuple[str, bytes, bytes | None]] = []
        self.failures = failures

    async def __call__(self, topic: str, value: bytes, key: bytes | None) -> object:
        if self.failures:
            self.failures -= 1
            raise KafkaTimeoutError()
        self.sent.append((topic, value, key))
        return None


async def _audit_one(audit: Audit, **overrides: Any) -> None:
    fields: dict[str, Any] = {
        "request_id": "req-1",
        "model_name": "double",
        "model_version": "1",
        "outcome": "result",
        "error_code": None,
        "latency_s": 0.0125,
    }
    fields.update(overrides)
    await audit.record(_record(), **fields)


def test_record_holds_digests_and_metadata_never_the_payload_or_key() -> None:
    """Every field is there; key and value appear only as their SHA-256."""
    moment = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    entry = audit_record(
        _record(),
        worker_id="worker-a",
        request_id="req-1",
        model_name="double",
        model_version="1",
        outcome="dead_letter",
        error_code="FORBIDDEN",
        latency_s=0.0125,
        now=moment,
    )
    assert entry == {
        "request_id": "req-1",
        "key_sha256": hashlib.sha256(KEY).hexdigest(),
        "payload_sha256": hashlib.sha256(PAYLOAD).hexdigest(),
        "payload_bytes": len(PAYLOAD),
        "source_topic": "requests",
        "source_partition": 3,
        "source_offset": 17,
        "model_name": "double",
        "model_version": "1",
        "outcome": "dead_letter",
        "error_code": "FORBIDDEN",
        "latency_ms": 12.5,
        "worker_id": "worker-a",
        "timestamp": "2024-05-01T12:00:00.000Z",
    }
    text = json.dumps(entry)
    assert "secret-input" not in text and KEY.decode() not in text


def test_absent_key_and_tombstone_have_no_digest() -> None:
    """A record without key or value gets null digests and 0 payload bytes."""
    entry = audit_record(
        _record(value=None, key=None),
        worker_id="w",
        request_id=None,
        model_name=None,
        model_version=None,
        outcome="dead_letter",
        error_code="DECODE_ERROR",
        latency_s=0.0,
    )
    assert (entry["key_sha256"], entry["payload_sha256"], entry["payload_bytes"]) == (
        None,
        None,
        0,
    )


async def test_audit_none_writes_nothing() -> None:
    """WORKER_AUDIT=none: no send, no log line."""
    sends = _Sends()
    audit = Audit(_settings(), sends)
    with structlog.testing.capture_logs() as logs:
        await _audit_one(audit)
    assert (sends.sent, logs, audit.enabled) == ([], [], False)


async def test_audit_log_writes_one_line_on_the_dedicated_logger() -> None:
    """WORKER_AUDIT=log: one 'audit' event through the worker.audit logger, no payload."""
    sends = _Sends()
    audit = Audit(_settings(audit="log", log_level="error"), sends)
    with structlog.testing.capture_logs() as logs:
        await _audit_one(audit)
    assert sends.sent == []
    assert len(logs) == 1
    assert logs[0]["event"] == "audit" and logs[0]["request_id"] == "req-1"
    assert logs[0]["payload_sha256"] == hashlib.sha256(PAYLOAD).hexdigest()
    assert "secret-input" not in json.dumps(logs[0])
    # Kept whatever the worker's log level: the audit logger passes info.
    assert logging.getLogger(AUDIT_LOGGER).isEnabledFor(logging.INFO)


async def test_audit_topic_sends_json_keyed_by_request_id() -> None:
    """WORKER_AUDIT=topic: one JSON record to the audit topic, keyed by request id."""
    sends = _Sends()
    audit = Audit(_settings(audit="topic", audit_topic="audit"), sends)
    with structlog.testing.capture_logs() as logs:
        await _audit_one(audit, outcome="dead_letter", error_code="TOO_LARGE")
    assert logs == []
    [(topic, value, key)] = sends.sent
    entry = json.loads(value)
    assert (topic, key) == ("audit", b"req-1")
    assert (entry["outcome"], entry["error_code"], entry["worker_id"]) == (
        "dead_letter",
        "TOO_LARGE",
        "worker-a",
    )
    assert PAYLOAD not in value


async def test_audit_both_logs_and_sends() -> None:
    """WORKER_AUDIT=both: one log line and one topic record, the same content."""
    sends = _Sends()
    audit = Audit(_settings(audit="both", audit_topic="audit"), sends)
    with structlog.testing.capture_logs() as logs:
        await _audit_one(audit)
    [(_, value, _)] = sends.sent
    logged = {k: v for k, v in logs[0].items() if k not in ("event", "log_level")}
    assert logged == json.loads(value)


async def test_audit_topic_retries_then_fails_loudly() -> None:
    """A send failing once is retried; failing every time raises AuditWriteFailed."""
    flaky = _Sends(failures=1)
    await _audit_one(Audit(_settings(audit="topic", audit_topic="audit"), flaky, topic_attempts=2))
    assert len(flaky.sent) == 1
    broken = _Sends(failures=5)
    audit = Audit(_settings(audit="topic", audit_topic="audit"), broken, topic_attempts=2)
    with pytest.raises(AuditWriteFailed, match="failed 2 times"):
        await _audit_one(audit)


async def test_audit_lines_reach_the_configured_log_even_at_level_error() -> None:
    """With WORKER_LOG_LEVEL=error, the audit line is still written, as JSON, by worker.audit."""
    stream = io.StringIO()
    configure_logging("json", "error", stream=stream)
    try:
        await _audit_one(Audit(_settings(audit="log", log_level="error"), _Sends()))
        structlog.get_logger("worker.record").info("not_shown_at_error")
    finally:
        reset_logging()
    [line] = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert (line["event"], line["logger"], line["request_id"]) == ("audit", AUDIT_LOGGER, "req-1")


class _SendsTogether:
    """Collects what the audit hands over together; refuses the records at ``refused``."""

    def __init__(self, refused: Sequence[int] = ()) -> None:
        self.calls: list[tuple[str, list[tuple[bytes | None, bytes, Any]]]] = []
        self.refused = set(refused)

    async def __call__(
        self, topic: str, records: Sequence[tuple[bytes | None, bytes, Any]]
    ) -> list[BaseException | None]:
        self.calls.append((topic, list(records)))
        return [KafkaTimeoutError() if i in self.refused else None for i in range(len(records))]


def _entries(n: int) -> list[AuditEntry]:
    return [
        AuditEntry(_record(), f"req-{i}", "double", "1", "result", None, 0.01) for i in range(n)
    ]


async def test_a_groups_audit_records_are_handed_over_together() -> None:
    """record_many with an audit topic: one hand-over of every record (keyed by request
    id, the same JSON as one by one), no write of its own per record."""
    one_by_one, together = _Sends(), _SendsTogether()
    audit = Audit(_settings(audit="topic", audit_topic="audit"), one_by_one, send_many=together)
    await audit.record_many(_entries(3))
    [(topic, records)] = together.calls
    assert topic == "audit" and one_by_one.sent == []
    assert [key for key, _, _ in records] == [b"req-0", b"req-1", b"req-2"]
    assert [json.loads(value)["request_id"] for _, value, _ in records] == [
        "req-0",
        "req-1",
        "req-2",
    ]


async def test_audit_records_refused_in_a_group_are_written_again_alone() -> None:
    """The records the hand-over did not land are written one by one, with retries; the
    others are not written twice."""
    one_by_one, together = _Sends(failures=1), _SendsTogether(refused=[1])
    audit = Audit(
        _settings(audit="topic", audit_topic="audit"),
        one_by_one,
        send_many=together,
        topic_attempts=2,
    )
    with structlog.testing.capture_logs() as logs:
        await audit.record_many(_entries(3))
    assert [key for _, _, key in one_by_one.sent] == [b"req-1"]
    assert "audit_records_written_again" in [e["event"] for e in logs]
    broken = Audit(
        _settings(audit="topic", audit_topic="audit"),
        _Sends(failures=5),
        send_many=_SendsTogether(refused=[0]),
        topic_attempts=2,
    )
    with pytest.raises(AuditWriteFailed, match="failed 2 times"):
        await broken.record_many(_entries(2))
