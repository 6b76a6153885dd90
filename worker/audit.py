"""One audit record per request: who asked what of which model, and how it ended."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiokafka.structs import ConsumerRecord

from worker.config import Settings

#: Sends (topic, value, key) and waits for the broker's ack.
Send = Callable[[str, bytes, bytes | None], Awaitable[object]]


class Audit:
    """Writes audit records to a log stream and/or an audit topic, per ``WORKER_AUDIT``."""

    def __init__(self, settings: Settings, send: Send) -> None:
        self._settings = settings
        self._send = send

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
        """Audit one finished request (result or dead letter). Never holds the payload."""
        return None
