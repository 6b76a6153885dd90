"""One record, start to end: decode, validate, infer (with retries), publish the outcome.

Every record ends in exactly one of: a result, or a dead letter. ``evaluate``
computes it; ``deliver`` publishes it through the sink and returns once the
broker has acknowledged it (or the transaction holding it has committed). The
caller marks the record done only then.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

import structlog
from aiokafka.structs import ConsumerRecord

from worker import codec, errors
from worker.audit import Audit
from worker.batching import MicroBatcher
from worker.breaker import CircuitBreaker
from worker.config import Settings
from worker.limiter import AdaptiveLimiter
from worker.observability import Metrics
from worker.publisher import Headers
from worker.security import check_model_allowed
from worker.triton import TritonPool
from worker.validation import ModelSpec, check_request

log = structlog.get_logger(__name__)

_T = TypeVar("_T")


@dataclass(slots=True)
class _Budget:
    """One monotonic deadline per record, shared by all its retries."""

    deadline: float
    failures: int = 0

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()


@dataclass(slots=True)
class Outcome:
    """How a record ends: a result value with its headers, or an error for a dead letter."""

    record: ConsumerRecord[bytes, bytes]
    started: float
    request: codec.DecodedRequest | None = None
    value: bytes | None = None
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    error: errors.WorkerError | None = None
    served_version: str | None = None


class Sink(Protocol):
    """Where outcomes go: straight to the broker, or into a Kafka transaction."""

    async def publish_result(
        self, record: ConsumerRecord[bytes, bytes], value: bytes, headers: Headers
    ) -> None: ...

    async def publish_dead_letter(
        self, record: ConsumerRecord[bytes, bytes], headers: Headers
    ) -> None: ...


class RecordHandler:
    """Turns a consumed record into a published result or dead letter."""

    def __init__(
        self,
        settings: Settings,
        pool: TritonPool,
        sink: Sink,
        metrics: Metrics,
        audit: Audit,
        breaker: CircuitBreaker,
        batcher: MicroBatcher,
        limiter: AdaptiveLimiter | None = None,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._sink = sink
        self._metrics = metrics
        self._audit = audit
        self._breaker = breaker
        self._batcher = batcher
        self._limiter = limiter
        # Per-model metric children: labels() is a locked dict lookup, too dear per record.
        self._model_metrics: dict[str, tuple[Any, Any]] = {}

    async def evaluate(self, record: ConsumerRecord[bytes, bytes]) -> Outcome:
        """Decode, validate and infer: the record's result, or why it must be dead-lettered."""
        outcome = Outcome(record, time.monotonic())
        budget = _Budget(outcome.started + self._settings.record_deadline_ms / 1000)
        try:
            request = codec.decode_request(
                record.value,
                record.headers,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                default_model=self._settings.default_model,
                max_request_bytes=self._settings.max_request_bytes,
                max_tensor_elements=self._settings.max_tensor_elements,
                max_tensor_bytes=self._settings.max_tensor_bytes,
            )
            outcome.request = request
            structlog.contextvars.bind_contextvars(request_id=request.request_id)
            check_model_allowed(self._settings, record.topic, request.model_name)
            spec = await self._retrying(
                budget, lambda _: self._pool.model_spec(request.model_name, request.model_version)
            )
            check_request(spec, request)
            response = await self._infer(request, spec, budget)
            outcome.served_version = response.model_version
            outcome.value, encoding_headers = codec.encode_result(
                request, response, max_result_bytes=self._settings.max_output_bytes
            )
            outcome.headers = codec.result_headers(
                record.headers,
                request,
                encoding_headers,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                served_model_version=response.model_version,
            )
        except errors.WorkerError as error:
            # Retries exhausted: every try failed. Otherwise the last try was the fatal one.
            exhausted = isinstance(error, errors.RetriesExhausted)
            self._fail(outcome, error, budget.failures + (0 if exhausted else 1))
        return outcome

    def _fail(self, outcome: Outcome, error: errors.WorkerError, attempts: int) -> None:
        record = outcome.record
        outcome.error, outcome.value = error, None
        outcome.headers = codec.dead_letter_headers(
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

    async def deliver(self, outcome: Outcome) -> None:
        """Publish the outcome through the sink; return once the broker has it."""
        if outcome.value is not None:
            try:
                await self._sink.publish_result(outcome.record, outcome.value, outcome.headers)
            except errors.OutputTooLarge as error:
                self._fail(outcome, error, 1)
        if outcome.error is not None:
            await self._sink.publish_dead_letter(outcome.record, outcome.headers)
            self._metrics.dead_letters_total.labels(code=outcome.error.code).inc()
        else:
            assert outcome.request is not None
            self._metrics_for(outcome.request.model_name)[0].inc()
        await self._audit.record(
            outcome.record,
            request_id=outcome.request.request_id if outcome.request else None,
            model_name=outcome.request.model_name if outcome.request else None,
            model_version=outcome.served_version
            or (outcome.request.model_version if outcome.request else None),
            outcome="dead_letter" if outcome.error else "result",
            error_code=outcome.error.code if outcome.error else None,
            latency_s=time.monotonic() - outcome.started,
        )
        self._metrics.end_to_end_latency_seconds.observe(
            max(0.0, time.time() - outcome.record.timestamp / 1000)
        )

    def _metrics_for(self, model_name: str) -> tuple[Any, Any]:
        """(results published counter, inference latency histogram) of ``model_name``."""
        children = self._model_metrics.get(model_name)
        if children is None:
            model = self._metrics.model_label(model_name)
            children = (
                self._metrics.results_published_total.labels(model=model),
                self._metrics.inference_latency_seconds.labels(model=model),
            )
            self._model_metrics[model_name] = children
        return children

    async def _infer(self, request: codec.DecodedRequest, spec: ModelSpec, budget: _Budget) -> Any:
        latency = self._metrics_for(request.model_name)[1]
        try_timeout_s = self._settings.request_timeout_ms / 1000

        async def once(timeout_s: float) -> Any:
            started = time.monotonic()
            try:
                response = await self._batcher.infer(request, spec, min(timeout_s, try_timeout_s))
            except (errors.TritonOverloaded, errors.TritonTimeout):
                if self._limiter is not None:
                    self._limiter.on_overload()
                raise
            latency_s = time.monotonic() - started
            latency.observe(latency_s)
            if self._limiter is not None:
                self._limiter.on_success(latency_s)
            return response

        return await self._retrying(budget, once)

    async def _retrying(self, budget: _Budget, call: Callable[[float], Awaitable[_T]]) -> _T:
        """Call with the remaining time; retry retryable failures with full-jitter backoff.

        An outage (Triton unreachable) is not the record's fault: it feeds the
        circuit breaker, never counts as a try, and while the breaker is open
        the record waits for it to close with its deadline paused.
        """
        while True:
            try:
                result = await call(max(0.001, budget.remaining_s()))
            except errors.WorkerError as error:
                if not error.retryable:
                    raise
                if isinstance(error, errors.TritonUnavailable):
                    self._breaker.record_failure()
                    if self._breaker.is_open:
                        budget.deadline += await self._breaker.wait_closed()
                        continue
                    if budget.remaining_s() <= 0:
                        raise errors.RetriesExhausted.after(error, budget.failures + 1) from error
                    self._metrics.retries_total.labels(reason=error.code).inc()
                    await asyncio.sleep(random.uniform(0, self._settings.retry_backoff_ms / 1000))
                    continue
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
            else:
                self._breaker.record_success()
                return result
