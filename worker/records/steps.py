"""The steps both paths share, written once: admit, encode, and record how a record ended.

``single`` calls them record by record, ``batch`` once per micro-batch or per group (the
``_many`` forms, which do the per-record part in one loop; a record of the per-record path
is booked by the same code as a group of one). What a record's outcome
updates (latencies, the adaptive limiter, the circuit breaker, the models' health, the
counters, the audit trail, the internal-error log and stop rule) is updated here and
nowhere else, so a new signal is written once and both paths have it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple, Protocol

import structlog

from worker import errors, wire
from worker.audit import Audit, AuditEntry
from worker.events import decode_event
from worker.flow.breaker import CircuitBreaker
from worker.flow.guard import InternalErrorGuard
from worker.flow.holds import ModelGate
from worker.flow.limiter import AdaptiveLimiter
from worker.flow.model_health import ModelHealth
from worker.flow.retry import Budget, Retrier
from worker.kafka.types import ConsumerRecord
from worker.observability import Metrics
from worker.observability.metrics import observe_all, observe_times
from worker.records.refusals import OutputRefusals, record_bytes
from worker.records.rules import RecordRules
from worker.wire import Headers, Source
from worker.wire.batch_results import BatchResults
from worker.wire.validation import ModelSpec, check_request

__all__ = ["FALLBACK_REASONS", "Answered", "Steps"]

log = structlog.get_logger(__name__)

#: Headers the steps write (a result's, a dead letter's).
Written = list[tuple[str, bytes | None]]

#: Why the batch path hands a record to the per-record path.
FALLBACK_REASONS = ("decode", "inference", "encode", "publish", "order", "internal")


class Answered(Protocol):
    """A record whose outcome the broker has: the record, and its decoded request when a
    result of it is to be counted (None: a dead letter, or results counted already)."""

    @property
    def record(self) -> ConsumerRecord[bytes, bytes]: ...

    @property
    def request(self) -> wire.DecodedRequest | None: ...


class _Ended(NamedTuple):
    """A record of the per-record path, ended: the books of a group of one."""

    record: ConsumerRecord[bytes, bytes]
    request: wire.DecodedRequest | None


class Steps:
    """Admission, encoding and the bookkeeping of outcomes, for both paths."""

    def __init__(
        self,
        rules: RecordRules,
        *,
        metrics: Metrics,
        breaker: CircuitBreaker,
        limiter: AdaptiveLimiter | None,
        models: ModelGate | None,
        health: ModelHealth | None,
        audit: Audit,
    ) -> None:
        self.rules = rules
        self._metrics = metrics
        self._breaker = breaker
        self._limiter = limiter
        self._models = models
        self._health = health
        self._audit = audit
        self._guard = InternalErrorGuard(rules.max_consecutive_internal_errors)
        #: Results the output topic refused for their size lately (see refusals.py).
        self.refusals = OutputRefusals()
        #: A record's calls to Triton; what they end in is told back here.
        self.retrier = Retrier(
            rules.retry, breaker, models, self.retried, health, on_success=self.answered
        )
        # The validation is wire's own function: no wrapper on the hot path.
        self.check = check_request
        self.allow = rules.check_model_allowed
        # Per-model metric children: labels() is a locked dict lookup, too dear per record.
        # Keyed by label value, which Metrics.model_label bounds.
        self._model_metrics: dict[str, tuple[Any, Any]] = {}
        self._stream_metrics: dict[str, tuple[Any, Any, Any]] = {}

    # -- admission -------------------------------------------------------------------

    def decode(
        self, value: bytes | None, headers: Headers, source: Source, *, defer: bool = False
    ) -> wire.DecodedRequest:
        """The record's request, decoded within the limits (WorkerError when it cannot be).

        ``allow(topic, model)`` (Forbidden) and ``check(spec, request)`` (against the
        model's inputs) complete the admission once the caller knows what they need.
        """
        rules = self.rules
        wire.check_header_keys(headers)
        mapping = rules.mappings.get(source.topic) if rules.mappings else None
        if mapping is not None:
            return decode_event(
                mapping, value, headers, source, rules.limits, rules.registry, defer=defer
            )
        return wire.decode_request(
            value, headers, source, rules.limits, rules.default_model, defer=defer
        )

    async def schemas_ready(self, record: ConsumerRecord[bytes, bytes], budget: Budget) -> None:
        """Return once ``decode`` can read the record without asking the Schema Registry
        (at once, but for the first record of a registry-format topic's schema id; while
        the registry is out, it waits, the deadline paused)."""
        registry = self.rules.registry
        if registry is not None:
            await registry.ready(record.topic, record.value, budget)

    @staticmethod
    def fit(spec: ModelSpec, request: wire.DecodedRequest) -> None:
        """Shape a mapped event's request for its model (a batch dimension when it batches);
        an inference request is left as it is."""
        if request.event is not None:
            request.event.fit(spec, request)

    def serving(self, name: str, version: str) -> bool:
        """False while the model is held (being reloaded) or failing (its breaker open)."""
        if self._models is not None and self._models.is_held(name, version):
            return False
        return self._health is None or not self._health.is_open(name, version)

    @property
    def outage(self) -> bool:
        """True while the circuit breaker is open: Triton is out of reach."""
        return self._breaker.is_open

    @property
    def audits(self) -> bool:
        """True when every outcome is audited (``WORKER_AUDIT``)."""
        return self._audit.enabled

    # -- encoding ----------------------------------------------------------------------

    def encode(
        self,
        request: wire.DecodedRequest,
        response: Any,
        record: ConsumerRecord[bytes, bytes],
        source: Source,
        extra: Sequence[tuple[str, bytes]] = (),
    ) -> tuple[bytes, Written]:
        """A response as the record's result: its value (OutputTooLarge over the limit) and
        headers."""
        value, encoding = wire.encode_result(
            request, response, max_result_bytes=self.rules.max_output_bytes
        )
        served = response.model_version
        return self._result(request, value, encoding, record, source, served, extra=extra)

    def encode_row(
        self,
        results: BatchResults,
        index: int,
        rows: int,
        request: wire.DecodedRequest,
        record: ConsumerRecord[bytes, bytes],
        source: Source,
        *,
        headers: wire.ResultHeaders | None = None,
    ) -> tuple[bytes, Written]:
        """The ``index``-th record's part of a batched response as its result (as ``encode``
        makes it of that part alone); ``headers``: its micro-batch's result headers."""
        value, encoding = results.encode(index, rows, request, self.rules.max_output_bytes)
        served = results.model_version
        return self._result(request, value, encoding, record, source, served, made=headers)

    def _result(
        self,
        request: wire.DecodedRequest,
        value: bytes,
        encoding: Sequence[tuple[str, bytes]],
        record: ConsumerRecord[bytes, bytes],
        source: Source,
        served_version: str,
        *,
        extra: Sequence[tuple[str, bytes]] = (),
        made: wire.ResultHeaders | None = None,
    ) -> tuple[bytes, Written]:
        """The value and its headers (by ``made`` when given), the whole result checked
        against the output topic's known ceiling."""
        if made is not None:
            headers = made.of(record.headers, request, encoding, source, extra=extra)
        else:
            headers = wire.result_headers(
                record.headers,
                request,
                encoding,
                source,
                served_model_version=served_version,
                extra=extra,
            )
        ceiling = self.refusals.ceiling()
        if ceiling is not None:
            # Measured as the broker measures it: the result carries the request's key and
            # headers, and the ceiling was learnt from such a whole record.
            size = record_bytes(record.key, value, headers)
            if size >= ceiling:
                raise errors.OutputTooLarge(
                    f"result of model {request.model_name!r} is {size} bytes with its key and "
                    f"headers ({len(value)} of value); the output topic refused one of "
                    f"{ceiling} bytes for its size less than {self.refusals.remember_s:.0f} s "
                    "ago: raise the topic's max.message.bytes"
                )
        return value, headers

    def dead_letter(
        self, record_headers: Headers, error: errors.WorkerError, source: Source, attempts: int
    ) -> Written:
        """The headers of the record's dead letter; the failure is logged."""
        headers = wire.dead_letter_headers(
            record_headers,
            error,
            source,
            attempts=attempts,
            group_id=self.rules.group_id,
            failed_at=datetime.now(UTC),
            style=self.rules.dlq_header_style,
        )
        log.warning("dead_letter", code=error.code, error=error.message, attempts=attempts)
        return headers

    def plain_dead_letter(
        self, exc: BaseException, source: Source
    ) -> tuple[errors.InternalError, Written]:
        """Writing the dead letter met a bug: logged and counted; a plain one instead, with
        the worker's headers only (the record's own may be what broke it)."""
        log.error("dead_letter_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        self._metrics.internal_errors_total.inc()
        error = errors.InternalError.wrapping(exc)
        headers = wire.dead_letter_headers(
            (),
            error,
            source,
            attempts=1,
            group_id=self.rules.group_id,
            failed_at=datetime.now(UTC),
            style=self.rules.dlq_header_style,
        )
        return error, headers

    # -- calls to Triton -----------------------------------------------------------------

    def inferred(self, model_name: str, latency_s: float, count: int = 1) -> None:
        """``count`` inferences of the model answered in ``latency_s`` (per-record path: one;
        a micro-batch: its requests, at once): each one's latency and adaptive-limit sample
        (the limiter's sample windows are counted in requests)."""
        observe_times(self._children(model_name)[1], latency_s, count)
        if self._limiter is not None:
            self._limiter.on_success(latency_s, count)

    def inferred_many(self, model: tuple[str, str], latency_s: float, count: int) -> None:
        """A micro-batch of ``count`` requests answered at once: ``inferred`` for them, then
        the breakers, once (the per-record path tells them through ``answered``)."""
        self.inferred(model[0], latency_s, count)
        self._breaker.record_success()
        if self._health is not None:
            self._health.succeeded_many(model, count)

    def answered(self, model: tuple[str, str] | None, probe: bool) -> None:
        """A call to Triton succeeded (the retrier's report): the circuit breaker's count
        restarts; ``model``, when the call was one of its inferences, counts it as a
        success (``probe``: the call was the failing model's probe)."""
        if model is not None and self._health is not None:
            self._health.succeeded(model, probe)
        self._breaker.record_success()

    def overloaded(self, exc: BaseException) -> None:
        """A call failed; Triton overloaded or late lowers the adaptive limit."""
        if self._limiter is not None and isinstance(
            exc, (errors.TritonOverloaded, errors.TritonTimeout)
        ):
            self._limiter.on_overload()

    def retried(self, code: str) -> None:
        """A record's call is tried again after a failure of ``code``."""
        self._metrics.retries_total.labels(reason=code).inc()

    # -- outcomes --------------------------------------------------------------------

    def internal(self, exc: BaseException) -> None:
        """A bug met while handling a record (which becomes a dead letter): logged, counted."""
        log.error("internal_error", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        self._metrics.internal_errors_total.inc()

    def internal_failure(self, exc: BaseException) -> None:
        """A bug met in the bookkeeping around records, which stay not done: logged, counted,
        and one more in the run of bugs (TooManyInternalErrors at the limit)."""
        self.internal(exc)
        self._guard.observe(True)

    def outcome_reached(self, internal: bool) -> None:
        """A record's outcome is about to go out; ``internal``: it met a bug.

        Raises TooManyInternalErrors when too many records in a row met one.
        """
        self._guard.observe(internal)

    def published(self, model_name: str, count: int = 1) -> None:
        """``count`` results of the model are published (a stream's, as they go out)."""
        self._children(model_name)[0].inc(count)

    async def ended(
        self,
        record: ConsumerRecord[bytes, bytes],
        request: wire.DecodedRequest | None,
        *,
        error: errors.WorkerError | None,
        served_version: str | None,
        started: float,
        counted: bool,
    ) -> None:
        """A record's outcome is published (per-record path): booked as a group of one
        (``_acknowledged``; its result counted unless ``counted`` already, a stream's), a
        dead letter counted by its code, then audited.

        Raises AuditWriteFailed when the audit topic never takes its audit record.
        """
        if error is not None:
            self._metrics.dead_letters_total.labels(code=error.code).inc()
        else:
            assert request is not None
        # A dead letter, or a stream's results (counted as they went out): its latency only.
        self._acknowledged((_Ended(record, None if error or counted else request),))
        await self._audit.record(
            record,
            request_id=request.request_id if request else None,
            model_name=request.model_name if request else None,
            model_version=served_version or (request.model_version if request else None),
            outcome="dead_letter" if error else "result",
            error_code=error.code if error else None,
            latency_s=time.monotonic() - started,
        )

    async def audit_many(
        self, done: Sequence[tuple[ConsumerRecord[bytes, bytes], wire.DecodedRequest, str, float]]
    ) -> None:
        """Audit results of the group path the broker has: (record, request, served version,
        when it was taken); with an audit topic, returns once every audit record is
        acknowledged (AuditWriteFailed when one never is)."""
        now = time.monotonic()
        await self._audit.record_many(
            [
                AuditEntry(
                    record,
                    request_id=request.request_id,
                    model_name=request.model_name,
                    model_version=served or request.model_version,
                    outcome="result",
                    error_code=None,
                    latency_s=now - started,
                )
                for record, request, served, started in done
            ]
        )

    def published_many(self, done: Sequence[Answered]) -> None:
        """Results of the batch path acknowledged: ``_acknowledged``, the batch path's count;
        a run of bugs ends."""
        if not done:
            return
        self._acknowledged(done)
        self._metrics.fast_path_records_total.inc(len(done))
        self._guard.observe(False)

    def _acknowledged(self, done: Sequence[Answered]) -> None:
        """Outcomes the broker has, of either path: each one's end-to-end latency; the
        results of those with a request counted per model, one increment per model."""
        now = time.time()
        observe_all(
            self._metrics.end_to_end_latency_seconds,
            [max(0.0, now - answered.record.timestamp / 1000) for answered in done],
        )
        per_model: dict[str, int] = {}
        for answered in done:
            request = answered.request
            if request is not None:
                model = request.model_name
                per_model[model] = per_model.get(model, 0) + 1
        for model, count in per_model.items():
            self.published(model, count)

    def fallback_counters(self) -> dict[str, Any]:
        """The counters of records the batch path hands over, by reason (made when the batch
        path is, so their series exist from its start)."""
        counter = self._metrics.fast_path_fallbacks_total
        return {reason: counter.labels(reason=reason) for reason in FALLBACK_REASONS}

    def _children(self, model_name: str) -> tuple[Any, Any]:
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

    def stream_metrics(self, model_name: str) -> tuple[Any, Any, Any]:
        """(first response, gaps, responses per request) of ``model_name``'s streams."""
        model, m = self._metrics.model_label(model_name), self._metrics
        children = self._stream_metrics.get(model)  # keyed by label value: bounded
        if children is None:
            children = (
                m.stream_first_response_seconds.labels(model=model),
                m.stream_response_gap_seconds.labels(model=model),
                m.stream_responses.labels(model=model),
            )
            self._stream_metrics[model] = children
        return children
