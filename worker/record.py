"""One record, start to end: decode, validate, infer (with retries), publish the outcome.

Every record ends in exactly one of: a result (for a decoupled model in ``each``
mode, an ordered series of them), or a dead letter. ``evaluate`` computes it;
``deliver`` publishes it through the sink and returns once the broker has
acknowledged it (or the transaction holding it has committed). The caller marks
the record done only then.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import structlog
from aiokafka.structs import ConsumerRecord

from worker import errors, wire
from worker.audit import Audit
from worker.delivery.base import Sink
from worker.flow.breaker import CircuitBreaker
from worker.flow.guard import InternalErrorGuard
from worker.flow.holds import ModelGate
from worker.flow.limiter import AdaptiveLimiter
from worker.flow.model_health import ModelHealth
from worker.flow.ordering import Ticket
from worker.flow.retry import Backoff, Budget, Retrier, RetryPolicy
from worker.observability import Metrics
from worker.observability.inflight import DETACHED, InFlight
from worker.observability.tracing import Tracing
from worker.settings import Settings
from worker.streaming import StreamCalls, Streamed, StreamRules
from worker.triton.batching import MicroBatcher
from worker.triton.pool import TritonPool
from worker.wire import Source
from worker.wire.sequences import apply_sequence
from worker.wire.validation import ModelSpec, check_request

log = structlog.get_logger(__name__)


Allowlist = tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True, slots=True)
class RecordRules:
    """What the settings say about handling one record."""

    limits: wire.DecodeLimits
    default_model: str | None
    max_output_bytes: int
    allowlist: Allowlist  # (topic, models) rules; "*" allows every model
    group_id: str
    retry: RetryPolicy
    max_consecutive_internal_errors: int
    streams: StreamRules
    sequence_from_key: bool

    @classmethod
    def from_settings(cls, settings: Settings) -> RecordRules:
        limits, retry = settings.limits, settings.retry
        return cls(
            limits=wire.DecodeLimits(
                limits.max_request_bytes, limits.max_tensor_elements, limits.max_tensor_bytes
            ),
            default_model=limits.default_model,
            max_output_bytes=limits.max_output_bytes,
            allowlist=limits.model_allowlist,
            group_id=settings.kafka.group_id,
            retry=RetryPolicy(
                max_attempts=retry.max_attempts,
                backoff=Backoff(retry.retry_backoff_ms / 1000, retry.retry_backoff_max_ms / 1000),
                record_deadline_s=retry.record_deadline_ms / 1000,
                try_timeout_s=settings.triton.request_timeout_ms / 1000,
            ),
            max_consecutive_internal_errors=retry.max_consecutive_internal_errors,
            streams=StreamRules.from_settings(settings),
            sequence_from_key=settings.delivery.sequence_from_key,
        )

    def check_model_allowed(self, topic: str, model: str) -> None:
        """Raise Forbidden when the input topic may not use ``model``."""
        for rule_topic, models in self.allowlist:
            if rule_topic == topic and "*" not in models and model not in models:
                raise errors.Forbidden(f"model {model!r} is not allowed for topic {topic!r}")


@dataclass(slots=True)
class Outcome:
    """How a record ends: a result value with its headers, or an error for a dead letter."""

    record: ConsumerRecord[bytes, bytes]
    source: Source
    started: float
    request: wire.DecodedRequest | None = None
    value: bytes | None = None
    headers: list[tuple[str, bytes | None]] = field(default_factory=list)
    error: errors.WorkerError | None = None
    served_version: str | None = None
    streamed: Streamed | None = None  # a decoupled model's results (or live stream)


#: Exceptions that are not a record's failure: they end the record's task as they are.
_CONTROL_FLOW = (errors.Fatal, errors.PartitionRevoked)


class RecordHandler:
    """Turns a consumed record into a published result or dead letter."""

    def __init__(
        self,
        rules: RecordRules,
        *,
        pool: TritonPool,
        batcher: MicroBatcher,
        sink: Sink,
        metrics: Metrics,
        audit: Audit,
        breaker: CircuitBreaker,
        limiter: AdaptiveLimiter | None = None,
        models: ModelGate | None = None,
        tracing: Tracing | None = None,
        health: ModelHealth | None = None,
    ) -> None:
        self._rules = rules
        self._tracing = tracing or Tracing()
        self._pool = pool
        self._sink = sink
        self._metrics = metrics
        self._audit = audit
        self._breaker = breaker
        self._batcher = batcher
        self._limiter = limiter
        self._retrier = Retrier(
            rules.retry,
            breaker,
            models,
            lambda code: metrics.retries_total.labels(reason=code).inc(),
            health,
        )
        self._streams = StreamCalls(rules.streams, pool, self._retrier, metrics)
        self.guard = InternalErrorGuard(rules.max_consecutive_internal_errors)
        # Per-model metric children: labels() is a locked dict lookup, too dear per record.
        # Keyed by label value, which Metrics.model_label bounds.
        self._model_metrics: dict[str, tuple[Any, Any]] = {}

    async def evaluate(
        self,
        record: ConsumerRecord[bytes, bytes],
        turn: Ticket | None = None,
        entry: InFlight = DETACHED,
    ) -> Outcome:
        """Decode, validate and infer: the record's result, or why it must be dead-lettered.

        ``turn``: the record's place among its key's records, taken only if its
        model keeps sequences (WORKER_SEQUENCE_FROM_KEY), handed on at once otherwise.
        Never raises for the record's sake: a bug met on the way (any unexpected
        exception) makes the record an INTERNAL_ERROR dead letter. ``entry``: the
        record's in-flight entry, told where the record is.
        """
        outcome = Outcome(record, Source.of(record), time.monotonic())
        budget = Budget(outcome.started + self._rules.retry.record_deadline_s, entry=entry)
        try:
            await self._evaluate(outcome, budget, turn)
        except errors.WorkerError as error:
            # Retries exhausted: every try failed. Otherwise the last try was the fatal one.
            exhausted = isinstance(error, errors.RetriesExhausted)
            self._fail(outcome, error, budget.failures + (0 if exhausted else 1))
        except _CONTROL_FLOW:
            raise
        except Exception as exc:
            self._internal(outcome, exc, budget.failures + 1)
        return outcome

    async def _evaluate(self, outcome: Outcome, budget: Budget, turn: Ticket | None) -> None:
        record = outcome.record
        if record.value is None and record.key is None:
            raise errors.DecodeError(
                "record has neither key nor value (both null); expected an inference request"
            )
        rules = self._rules
        request = wire.decode_request(
            record.value, record.headers, outcome.source, rules.limits, rules.default_model
        )
        outcome.request = request
        budget.entry.request_id, budget.entry.model = request.request_id, request.model_name
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        rules.check_model_allowed(record.topic, request.model_name)
        spec = await self._retrier.run(
            (request.model_name, request.model_version),
            budget,
            lambda _: self._pool.model_spec(request.model_name, request.model_version),
            inference=False,
        )
        check_request(spec, request)
        if spec.sequence and rules.sequence_from_key:
            apply_sequence(request, record.key, record.headers, string_ids=spec.string_sequence_ids)
        if turn is not None:
            await self._take_turn(turn, spec.sequence and rules.sequence_from_key, budget)
        if spec.decoupled:
            with self._tracing.infer(request.model_name, request.model_version):
                outcome.streamed = await self._streams.evaluate(
                    request, budget, outcome.source, record.headers
                )
            outcome.served_version = outcome.streamed.model_version
            return
        with self._tracing.infer(request.model_name, request.model_version):
            trace = self._tracing.to_triton(record.headers)
            response = await self._infer(request, spec, budget, trace)
        outcome.served_version = response.model_version
        outcome.value, encoding_headers = wire.encode_result(
            request, response, max_result_bytes=rules.max_output_bytes
        )
        outcome.headers = wire.result_headers(
            record.headers,
            request,
            encoding_headers,
            outcome.source,
            served_model_version=response.model_version,
        )

    @staticmethod
    async def _take_turn(turn: Ticket, needed: bool, budget: Budget) -> None:
        """Wait for the key's earlier records if ``needed`` (its deadline paused), else pass."""
        if not needed:
            turn.done()
            return
        started = time.monotonic()
        budget.entry.state = "waiting_turn"
        await turn.wait()
        budget.pause(time.monotonic() - started)

    def _internal(self, outcome: Outcome, exc: BaseException, attempts: int) -> None:
        """A bug met while handling this record: log it once, dead-letter the record."""
        log.error("internal_error", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        self._metrics.internal_errors_total.inc()
        self._fail(outcome, errors.InternalError.wrapping(exc), attempts)

    def internal_failure(self, exc: BaseException) -> None:
        """A bug met outside ``evaluate`` and ``deliver`` (bookkeeping): log and count it.

        The record is not marked done, so its offset is not committed and it is
        processed again by the partition's next owner. Raises TooManyInternalErrors
        at the limit.
        """
        log.error("internal_error", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        self._metrics.internal_errors_total.inc()
        self.guard.observe(True)

    def _fail(self, outcome: Outcome, error: errors.WorkerError, attempts: int) -> None:
        record = outcome.record
        outcome.error, outcome.value = error, None
        outcome.headers = wire.dead_letter_headers(
            record.headers,
            error,
            outcome.source,
            attempts=attempts,
            group_id=self._rules.group_id,
            failed_at=datetime.now(UTC),
        )
        log.warning("dead_letter", code=error.code, error=error.message, attempts=attempts)

    async def deliver(self, outcome: Outcome) -> None:
        """Publish the outcome through the sink; return once the broker has it.

        A result the sink cannot take becomes a dead letter (OUTPUT_TOO_LARGE, or
        INTERNAL_ERROR for an unexpected exception). Raises TooManyInternalErrors
        when too many records in a row met a bug, and WriteFailed when the dead
        letter can never be written.
        """
        with self._tracing.publish(outcome):
            await self._deliver(outcome)

    async def _deliver(self, outcome: Outcome) -> None:
        streamed = outcome.streamed
        if outcome.value is not None or streamed is not None:
            try:
                if streamed is not None:
                    await self._streams.publish(streamed, outcome.record, self._sink)
                elif outcome.value is not None:
                    await self._sink.publish_result(outcome.record, outcome.value, outcome.headers)
            except errors.WorkerError as error:  # OUTPUT_TOO_LARGE, or a stream failing midway
                self._fail(outcome, error, streamed.attempts if streamed is not None else 1)
            except _CONTROL_FLOW:
                raise
            except Exception as exc:
                self._internal(outcome, exc, 1)
        self.guard.observe(isinstance(outcome.error, errors.InternalError))
        if outcome.error is not None:
            await self._publish_dead_letter(outcome)
            self._metrics.dead_letters_total.labels(code=outcome.error.code).inc()
        elif streamed is None:  # a stream's results are counted as they are published
            assert outcome.request is not None
            self.metrics_for(outcome.request.model_name)[0].inc()
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

    async def _publish_dead_letter(self, outcome: Outcome) -> None:
        """The dead letter as built; if that meets a bug, a plain one with our headers only."""
        record = outcome.record
        try:
            await self._sink.publish_dead_letter(record, outcome.headers)
            return
        except _CONTROL_FLOW:
            raise
        except Exception as exc:
            log.error("dead_letter_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            self._metrics.internal_errors_total.inc()
            # The record's own headers may be what broke it: leave them out.
            error = errors.InternalError.wrapping(exc)
            outcome.error = error
            outcome.headers = wire.dead_letter_headers(
                (),
                error,
                outcome.source,
                attempts=1,
                group_id=self._rules.group_id,
                failed_at=datetime.now(UTC),
            )
        try:
            await self._sink.publish_dead_letter(record, outcome.headers)
        except _CONTROL_FLOW:
            raise
        except Exception as exc:
            raise errors.WriteFailed(
                f"dead letter of {outcome.source} cannot be written: {type(exc).__name__}: {exc}"
            ) from exc

    def metrics_for(self, model_name: str) -> tuple[Any, Any]:
        """(results published counter, inference latency histogram) of ``model_name``."""
        model = self._metrics.model_label(model_name)
        children = self._model_metrics.get(model)
        if children is None:
            children = (
                self._metrics.results_published_total.labels(model=model),
                self._metrics.inference_latency_seconds.labels(model=model),
            )
            self._model_metrics[model] = children
        return children

    async def _infer(
        self, request: wire.DecodedRequest, spec: ModelSpec, budget: Budget, trace: Any
    ) -> Any:
        latency = self.metrics_for(request.model_name)[1]
        try_timeout_s = self._rules.retry.try_timeout_s

        async def once(timeout_s: float) -> Any:
            started = time.monotonic()
            try:
                response = await self._batcher.infer(
                    request, spec, min(timeout_s, try_timeout_s), trace, budget.entry
                )
            except (errors.TritonOverloaded, errors.TritonTimeout):
                if self._limiter is not None:
                    self._limiter.on_overload()
                raise
            latency_s = time.monotonic() - started
            latency.observe(latency_s)
            if self._limiter is not None:
                self._limiter.on_success(latency_s)
            return response

        return await self._retrier.run((request.model_name, request.model_version), budget, once)
