"""One record, start to end: decode, validate, infer (with retries), publish the outcome.

Every record ends in exactly one of: a result, or a dead letter. The caller marks
it done only when this returns, that is once the broker has acknowledged what
was written.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import structlog
from aiokafka.structs import ConsumerRecord

from worker import codec, errors
from worker.audit import Audit
from worker.config import Settings
from worker.observability import Metrics
from worker.publisher import Publisher
from worker.security import check_model_allowed
from worker.triton import TritonPool
from worker.validation import check_request

log = structlog.get_logger(__name__)

_T = TypeVar("_T")


@dataclass(slots=True)
class _Budget:
    """One monotonic deadline per record, shared by all its retries."""

    deadline: float
    failures: int = 0

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()


class RecordHandler:
    """Turns a consumed record into a published result or dead letter."""

    def __init__(
        self,
        settings: Settings,
        pool: TritonPool,
        publisher: Publisher,
        metrics: Metrics,
        audit: Audit,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._publisher = publisher
        self._metrics = metrics
        self._audit = audit

    async def handle(self, record: ConsumerRecord[bytes, bytes]) -> None:
        """Process ``record``; returns once its result or dead letter is acknowledged."""
        started = time.monotonic()
        budget = _Budget(started + self._settings.record_deadline_ms / 1000)
        request: codec.DecodedRequest | None = None
        served_version: str | None = None
        try:
            request = codec.decode_request(
                record.value,
                record.headers,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                default_model=self._settings.default_model,
                max_request_bytes=self._settings.max_request_bytes,
            )
            structlog.contextvars.bind_contextvars(request_id=request.request_id)
            check_model_allowed(self._settings, record.topic, request.model_name)
            spec = await self._retrying(
                budget, lambda _: self._pool.model_spec(request.model_name, request.model_version)
            )
            check_request(spec, request)
            response = await self._infer(request, budget)
            value, encoding_headers = codec.encode_result(
                request, response, max_result_bytes=self._settings.max_output_bytes
            )
            headers = codec.result_headers(
                record.headers,
                request,
                encoding_headers,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                served_model_version=response.model_version,
            )
            served_version = response.model_version
            await self._publisher.publish_result(value, record.key, headers)
            self._metrics.results_published_total.labels(
                model=self._metrics.model_label(request.model_name)
            ).inc()
            outcome, code = "result", None
        except errors.WorkerError as error:
            # Retries exhausted: every try failed. Otherwise the last try was the fatal one.
            exhausted = isinstance(error, errors.RetriesExhausted)
            await self._dead_letter(record, error, budget.failures + (0 if exhausted else 1))
            outcome, code = "dead_letter", error.code
        await self._audit.record(
            record,
            request_id=request.request_id if request else None,
            model_name=request.model_name if request else None,
            model_version=served_version or (request.model_version if request else None),
            outcome=outcome,
            error_code=code,
            latency_s=time.monotonic() - started,
        )
        self._metrics.end_to_end_latency_seconds.observe(
            max(0.0, time.time() - record.timestamp / 1000)
        )

    async def _infer(self, request: codec.DecodedRequest, budget: _Budget) -> Any:
        model = self._metrics.model_label(request.model_name)

        async def once(timeout_s: float) -> Any:
            started = time.monotonic()
            response = await self._pool.infer(
                request.infer_request, min(timeout_s, self._settings.request_timeout_ms / 1000)
            )
            self._metrics.inference_latency_seconds.labels(model=model).observe(
                time.monotonic() - started
            )
            return response

        return await self._retrying(budget, once)

    async def _retrying(self, budget: _Budget, call: Callable[[float], Awaitable[_T]]) -> _T:
        """Call with the remaining time; retry retryable failures with full-jitter backoff."""
        while True:
            try:
                return await call(max(0.001, budget.remaining_s()))
            except errors.WorkerError as error:
                if not error.retryable:
                    raise
                budget.failures += 1
                settings = self._settings
                cap_s = min(
                    settings.retry_backoff_max_ms, settings.retry_backoff_ms * 2**budget.failures
                )
                backoff_s = random.uniform(0, cap_s / 1000)
                if budget.failures >= settings.max_attempts or backoff_s >= budget.remaining_s():
                    raise errors.RetriesExhausted.after(error, budget.failures) from error
                self._metrics.retries_total.labels(reason=error.code).inc()
                await asyncio.sleep(backoff_s)

    async def _dead_letter(
        self, record: ConsumerRecord[bytes, bytes], error: errors.WorkerError, attempts: int
    ) -> None:
        headers = codec.dead_letter_headers(
            record.headers,
            error,
            attempts=attempts,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            timestamp_ms=record.timestamp,
            group_id=self._settings.group_id,
            failed_at=datetime.now(UTC),
        )
        log.warning("dead_letter", code=error.code, error=error.message, attempts=attempts)
        await self._publisher.publish_dead_letter(record.value, record.key, headers)
        self._metrics.dead_letters_total.labels(code=error.code).inc()
