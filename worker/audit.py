"""One audit record per request: who asked what of which model, and how it ended.

A record holds digests, never content: the SHA-256 of the record's key and of
its value (the payload), so an auditor can match a record to a request they
hold without the audit trail itself carrying anyone's data.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

import orjson
import structlog

from worker.errors import WriteFailed
from worker.kafka.publisher import write_with_retries
from worker.kafka.types import ConsumerRecord, KafkaError
from worker.settings import Settings
from worker.wire import Headers

#: Sends (topic, value, key) and waits for the broker's ack.
Send = Callable[[str, bytes, bytes | None], Awaitable[object]]
#: Sends every (key, value, headers) to a topic together, then awaits the acks: per record
#: None once acknowledged, else the error that kept it out (``Producer.send_together``).
SendMany = Callable[
    [str, Sequence[tuple[bytes | None, bytes, Headers]]], Awaitable[list[BaseException | None]]
]

log = structlog.get_logger(__name__)

#: Name of the dedicated logger, so a log pipeline can route audit lines apart.
AUDIT_LOGGER = "worker.audit"
#: The event name of every audit log line.
AUDIT_EVENT = "audit"


class AuditWriteFailed(WriteFailed):
    """An audit record could not be written to the audit topic after every retry.

    The record's offset is not marked done: it is processed (and audited) again
    after a restart, rather than leaving a request without its audit record.
    """


def sha256_hex(data: bytes | None) -> str | None:
    """Hex SHA-256 of ``data``; None for an absent key or value."""
    return None if data is None else hashlib.sha256(data).hexdigest()


def audit_record(
    record: ConsumerRecord[bytes, bytes],
    *,
    worker_id: str,
    request_id: str | None,
    model_name: str | None,
    model_version: str | None,
    outcome: str,
    error_code: str | None,
    latency_s: float,
    now: datetime | None = None,
) -> dict[str, Any]:
    """The audit record of one finished request, as plain JSON-ready data (no payload)."""
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    return {
        "request_id": request_id,
        "key_sha256": sha256_hex(record.key),
        "payload_sha256": sha256_hex(record.value),
        "payload_bytes": len(record.value) if record.value is not None else 0,
        "source_topic": record.topic,
        "source_partition": record.partition,
        "source_offset": record.offset,
        "model_name": model_name,
        "model_version": model_version or None,
        "outcome": outcome,
        "error_code": error_code,
        "latency_ms": round(latency_s * 1000, 3),
        "worker_id": worker_id,
        "timestamp": moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
    }


class AuditEntry(NamedTuple):
    """What ``Audit.record`` takes of one finished request, for several at once."""

    record: ConsumerRecord[bytes, bytes]
    request_id: str | None
    model_name: str | None
    model_version: str | None
    outcome: str
    error_code: str | None
    latency_s: float


class Audit:
    """Writes audit records to a log stream and/or an audit topic, per ``WORKER_AUDIT``."""

    def __init__(
        self,
        settings: Settings,
        send: Send,
        *,
        send_many: SendMany | None = None,
        topic_attempts: int = 5,
    ) -> None:
        self._settings = settings
        self._send = send
        self._send_many = send_many
        self._to_log = settings.ops.audit in ("log", "both")
        self._to_topic = settings.ops.audit in ("topic", "both")
        self._topic = settings.ops.audit_topic
        self._topic_attempts = topic_attempts
        if self._to_log:
            # Audit lines are kept whatever WORKER_LOG_LEVEL says.
            logging.getLogger(AUDIT_LOGGER).setLevel(logging.INFO)

    @property
    def enabled(self) -> bool:
        """False when ``WORKER_AUDIT=none``: ``record`` then does nothing."""
        return self._to_log or self._to_topic

    async def record(
        self,
        record: ConsumerRecord[bytes, bytes],
        *,
        request_id: str | None,
        model_name: str | None,
        model_version: str | None,
        outcome: str,
        error_code: str | None,
        latency_s: float,
    ) -> None:
        """Audit one finished request (result or dead letter). Never holds the payload.

        With an audit topic, returns once the broker acknowledged the record;
        raises AuditWriteFailed when it never does.
        """
        if not (self._to_log or self._to_topic):
            return
        entry = audit_record(
            record,
            worker_id=self._settings.kafka.client_id,
            request_id=request_id,
            model_name=model_name,
            model_version=model_version,
            outcome=outcome,
            error_code=error_code,
            latency_s=latency_s,
        )
        if self._to_log:
            _audit_logger().info(AUDIT_EVENT, **entry)
        if self._to_topic:
            await self._write(entry)

    async def record_many(self, entries: Sequence[AuditEntry]) -> None:
        """Audit several finished requests at once: their log lines, then their topic
        records sent together (one hand-over to the producer, acknowledgements per batch),
        those refused tried again one by one (AuditWriteFailed if one never lands)."""
        if not (self._to_log or self._to_topic):
            return
        worker_id, now = self._settings.kafka.client_id, datetime.now(UTC)
        records = [
            audit_record(
                e.record,
                worker_id=worker_id,
                request_id=e.request_id,
                model_name=e.model_name,
                model_version=e.model_version,
                outcome=e.outcome,
                error_code=e.error_code,
                latency_s=e.latency_s,
                now=now,
            )
            for e in entries
        ]
        if self._to_log:
            logger = _audit_logger()
            for entry in records:
                logger.info(AUDIT_EVENT, **entry)
        if self._to_topic:
            await self._write_many(records)

    async def _write_many(self, entries: list[dict[str, Any]]) -> None:
        topic = self._topic
        assert topic is not None
        if self._send_many is None or len(entries) == 1:
            await asyncio.gather(*(self._write(entry) for entry in entries))
            return
        sent: list[tuple[bytes | None, bytes, Headers]] = [
            (_key(entry), orjson.dumps(entry), []) for entry in entries
        ]
        try:
            outcomes: list[BaseException | None] = await self._send_many(topic, sent)
        except KafkaError as exc:  # the producer's state: each is tried again alone
            outcomes = [exc] * len(sent)
        failed = [
            (e, error) for e, error in zip(entries, outcomes, strict=True) if error is not None
        ]
        if failed:
            first = failed[0][1]
            log.warning(
                "audit_records_written_again",
                records=len(failed),
                error=f"{type(first).__name__}: {first}",
            )
            await asyncio.gather(*(self._write(entry) for entry, _ in failed))

    async def _write(self, entry: dict[str, Any]) -> None:
        topic = self._topic
        assert topic is not None
        value, key = orjson.dumps(entry), _key(entry)
        await write_with_retries(
            lambda: self._send(topic, value, key),
            what=f"audit record to {topic!r}",
            attempts=self._topic_attempts,
            failure=AuditWriteFailed,
        )


def _key(entry: dict[str, Any]) -> bytes | None:
    """An audit record's key: its request id."""
    request_id = entry["request_id"]
    return request_id.encode() if request_id else None


def _audit_logger() -> Any:
    """The ``worker.audit`` logger through structlog's configured processors, unfiltered.

    The configured wrapper drops events below WORKER_LOG_LEVEL; audit lines must
    not depend on it, so the stdlib logger is wrapped here with the same processors.
    """
    processors = structlog.get_config()["processors"]
    return structlog.wrap_logger(
        logging.getLogger(AUDIT_LOGGER),
        processors=processors,
        wrapper_class=structlog.stdlib.BoundLogger,
    )
