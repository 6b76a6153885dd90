"""The batch-native fast path: the records of one fetch handled together, no task per record.

A record qualifies when nothing asks for the per-record path (see ``select``): it
decodes and validates, its model's spec is cached, the request may share a
Triton request with others, the model is neither held (reloading) nor failing
(its failure-rate breaker), and no unary trace call is asked for. The worker
enables the path only for ``at_least_once`` delivery, ``unordered`` ordering,
audit off and no spans (see ``worker.dispatch``).

The qualifying records of one dispatch pass are grouped by batch key into
micro-batches of at most min(WORKER_BATCH_MAX_SIZE, the model's max_batch_size)
rows; each is merged and sent with one ``TritonPool.infer`` (all concurrently,
within the per-try timeout), the response split and each record's result
encoded. The results go to the producer together (every send enqueued, then
the acks awaited), then the acknowledged records are marked done, per partition
at once, and the metrics are updated once per group where the metric allows.

Anything that goes wrong hands the record to the per-record path, which then
handles it from the start with its retries, bisection, holds and breakers:
every record of a micro-batch that failed (any error: a fast-path try is not
counted as an attempt, so a poison pill costs one extra Triton call), a result
that fails to encode, a result whose send failed (written again alone, with its
retries and size handling). The slot in the window and the in-flight entry pass
with the record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from aiokafka.structs import ConsumerRecord, TopicPartition

from worker import errors, wire
from worker.delivery.offsets import OffsetTracker
from worker.flow.breaker import CircuitBreaker
from worker.flow.guard import InternalErrorGuard
from worker.flow.holds import ModelGate
from worker.flow.limiter import AdaptiveLimiter
from worker.flow.model_health import ModelHealth
from worker.flow.window import Window
from worker.observability import InFlight, InFlightRegistry, Metrics
from worker.observability.tracing import Tracing
from worker.record import Outcome, RecordRules
from worker.triton.batching import batch_key, batchable
from worker.triton.merging import merge, split
from worker.triton.pool import TritonPool
from worker.wire import Headers, Source
from worker.wire.validation import ModelSpec, check_request

__all__ = ["BatchSink", "Candidate", "Fallback", "FastPath"]

log = structlog.get_logger(__name__)


class BatchSink(Protocol):
    """Results of several records at once (the at-least-once publisher)."""

    async def publish_many(
        self, results: Sequence[tuple[ConsumerRecord[bytes, bytes], bytes, Headers]]
    ) -> list[BaseException | None]: ...


@dataclass(slots=True)
class Candidate:
    """A record taken by the fast path: decoded, validated, its slot and entry held."""

    record: ConsumerRecord[bytes, bytes]
    generation: int
    source: Source
    request: wire.DecodedRequest
    spec: ModelSpec
    rows: int
    entry: InFlight
    started: float
    settled: bool = False  # done, or handed to the per-record path


#: Hands a record (its slot and in-flight entry with it) to the per-record path; with its
#: encoded outcome when only its publishing is left to do.
Fallback = Callable[[ConsumerRecord[bytes, bytes], int, Outcome | None, InFlight], None]


class FastPath:
    """Decodes, infers, publishes and marks done a group of records together."""

    def __init__(
        self,
        rules: RecordRules,
        *,
        pool: TritonPool,
        sink: BatchSink,
        offsets: OffsetTracker,
        window: Window,
        inflight: InFlightRegistry,
        metrics: Metrics,
        breaker: CircuitBreaker,
        models: ModelGate,
        health: ModelHealth | None,
        limiter: AdaptiveLimiter | None,
        guard: InternalErrorGuard,
        model_metrics: Callable[[str], tuple[Any, Any]],
        tracing: Tracing,
        batch_max_size: int,
        fallback: Fallback,
    ) -> None:
        """``model_metrics(name)``: the model's (results counter, latency histogram) children."""
        self._rules = rules
        self._pool = pool
        self._sink = sink
        self._offsets = offsets
        self._window = window
        self._inflight = inflight
        self._metrics = metrics
        self._breaker = breaker
        self._models = models
        self._health = health
        self._limiter = limiter
        self._guard = guard
        self._model_metrics = model_metrics
        self._tracing = tracing
        self._max_rows = batch_max_size
        self._fallback = fallback
        self._timeout_s = min(rules.retry.try_timeout_s, rules.retry.record_deadline_s)
        self._fallbacks = {
            reason: metrics.fast_path_fallbacks_total.labels(reason=reason)
            for reason in ("inference", "encode", "publish", "internal")
        }

    @property
    def open(self) -> bool:
        """False while the circuit breaker is open (an outage: the per-record path waits)."""
        return not self._breaker.is_open

    def select(self, record: ConsumerRecord[bytes, bytes], generation: int) -> Candidate | None:
        """The record as a candidate, or None when it needs the per-record path.

        Synchronous: decoding and validation happen here, once. A record that fails
        them goes to the per-record path, which decodes it again and dead-letters it.
        """
        value = record.value
        if value is None:
            return None
        rules, source = self._rules, Source.of(record)
        try:
            request = wire.decode_request(
                value, record.headers, source, rules.limits, rules.default_model
            )
            name, version = request.model_name, request.model_version
            spec = self._pool.cached_spec(name, version)
            if spec is None or spec.decoupled or spec.sequence:
                return None
            if self._models.is_held(name, version):
                return None
            if self._health is not None and self._health.is_open(name, version):
                return None
            if self._pool.trace_unary and self._tracing.to_triton(record.headers):
                return None  # its own unary call, carrying its trace context
            rules.check_model_allowed(record.topic, name)
            check_request(spec, request)
            if not batchable(spec, request):
                return None
        except Exception:
            return None
        entry = self._inflight.add(record)
        entry.request_id, entry.model, entry.state = request.request_id, name, "waiting_batch"
        rows = int(request.infer_request.inputs[0].shape[0])
        return Candidate(record, generation, source, request, spec, rows, entry, time.monotonic())

    async def run(self, candidates: list[Candidate]) -> None:
        """Answer the candidates; what fails goes to the per-record path. Never raises for
        a record's sake; a forced stop (cancelled) leaves the records not done."""
        try:
            await self._run(candidates)
        except errors.Fatal:
            raise
        except Exception as exc:
            # A bug in the group's bookkeeping: the records not done yet get a second
            # chance, each on its own (their results may appear twice: at least once).
            structlog.contextvars.bind_contextvars(records=len(candidates))
            self._hand_over([c for c in candidates if not c.settled], "internal")
            log.error("internal_error", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            self._metrics.internal_errors_total.inc()
            self._guard.observe(True)
        finally:
            self._release([c for c in candidates if not c.settled])

    async def _run(self, candidates: list[Candidate]) -> None:
        batches = self._micro_batches(candidates)
        if len(batches) == 1:
            answers = [await self._infer(batches[0])]
        else:
            answers = await asyncio.gather(*(self._infer(batch) for batch in batches))
        ready: list[tuple[Candidate, bytes, list[tuple[str, bytes | None]], str]] = []
        max_bytes = self._rules.max_output_bytes
        for batch, parts in zip(batches, answers, strict=True):
            if parts is None:
                self._hand_over(batch, "inference")
                continue
            for candidate, response in zip(batch, parts, strict=True):
                try:
                    value, encoding = wire.encode_result(
                        candidate.request, response, max_result_bytes=max_bytes
                    )
                    headers = wire.result_headers(
                        candidate.record.headers,
                        candidate.request,
                        encoding,
                        candidate.source,
                        served_model_version=response.model_version,
                    )
                except Exception:  # OUTPUT_TOO_LARGE, or a bug: the per-record path says which
                    self._hand_over([candidate], "encode")
                    continue
                candidate.entry.state = "publishing"
                ready.append((candidate, value, headers, response.model_version))
        if ready:
            acks = await self._sink.publish_many([(c.record, v, h) for c, v, h, _ in ready])
            self._settle(ready, acks)

    def _settle(
        self,
        ready: list[tuple[Candidate, bytes, list[tuple[str, bytes | None]], str]],
        acks: list[BaseException | None],
    ) -> None:
        """Mark the acknowledged records done (per partition at once), count them."""
        done: dict[tuple[TopicPartition, int], list[int]] = {}
        finished: list[Candidate] = []
        per_model: dict[str, int] = {}
        now = time.time()
        end_to_end = self._metrics.end_to_end_latency_seconds
        for (candidate, value, headers, served), ack in zip(ready, acks, strict=True):
            record = candidate.record
            if ack is not None:
                outcome = Outcome(record, candidate.source, candidate.started, candidate.request)
                outcome.value, outcome.headers, outcome.served_version = value, headers, served
                self._hand_over([candidate], "publish", outcome)
                continue
            tp = TopicPartition(record.topic, record.partition)
            done.setdefault((tp, candidate.generation), []).append(record.offset)
            model = candidate.request.model_name
            per_model[model] = per_model.get(model, 0) + 1
            end_to_end.observe(max(0.0, now - record.timestamp / 1000))
            candidate.settled = True
            finished.append(candidate)
        for (tp, generation), offsets in done.items():
            # False: the partition was revoked meanwhile; its next owner redoes the records.
            self._offsets.done_many(tp, offsets, generation)
        total = 0
        for model, count in per_model.items():
            self._model_metrics(model)[0].inc(count)
            total += count
        if total:
            self._metrics.fast_path_records_total.inc(total)
            self._guard.observe(False)
        # Their slots and entries go now (the caller's finally sees them settled).
        self._release(finished)

    def _micro_batches(self, candidates: list[Candidate]) -> list[list[Candidate]]:
        """Candidates grouped by batch key, cut at each model's row capacity, in order."""
        batches: list[list[Candidate]] = []
        open_batches: dict[tuple[object, ...], tuple[list[Candidate], int]] = {}
        for candidate in candidates:
            key = batch_key(candidate.request.infer_request)
            capacity = min(self._max_rows, candidate.spec.max_batch_size)
            current = open_batches.get(key)
            if current is not None and current[1] + candidate.rows <= capacity:
                current[0].append(candidate)
                open_batches[key] = (current[0], current[1] + candidate.rows)
                continue
            batch = [candidate]
            batches.append(batch)
            open_batches[key] = (batch, candidate.rows)
        return batches

    async def _infer(self, batch: list[Candidate]) -> list[Any] | None:
        """The batch's responses, one per candidate; None when the batch failed."""
        for candidate in batch:
            candidate.entry.state = "sent"
        requests = [c.request.infer_request for c in batch]
        started = time.monotonic()
        try:
            if len(batch) == 1:
                parts = [await self._pool.infer(requests[0], self._timeout_s)]
            else:
                rows = [c.rows for c in batch]
                response = await self._pool.infer(merge(requests), self._timeout_s)
                parts = split(response, rows, sum(rows))
                for part, request in zip(parts, requests, strict=True):
                    part.id = request.id
        except Exception as exc:
            # Outages and failures are seen by the breakers through the per-record path.
            if self._limiter is not None and isinstance(
                exc, (errors.TritonOverloaded, errors.TritonTimeout)
            ):
                self._limiter.on_overload()  # once: the per-record path tells the rest
            return None
        latency_s = time.monotonic() - started
        latency, limiter = self._model_metrics(batch[0].request.model_name)[1], self._limiter
        # One value per record, as on the per-record path: the limiter's sample windows
        # are counted in requests.
        for _ in batch:
            latency.observe(latency_s)
            if limiter is not None:
                limiter.on_success(latency_s)
        self._breaker.record_success()
        if self._health is not None:
            request = batch[0].request
            self._health.succeeded_many((request.model_name, request.model_version), len(batch))
        return parts

    def _hand_over(
        self, candidates: list[Candidate], reason: str, outcome: Outcome | None = None
    ) -> None:
        """Give the records (their slots and entries: their age goes on) to the per-record
        path."""
        for candidate in candidates:
            candidate.settled = True
            if outcome is None:
                candidate.entry.state = "decoding"  # it starts over
            self._fallback(candidate.record, candidate.generation, outcome, candidate.entry)
        self._fallbacks[reason].inc(len(candidates))

    def _release(self, candidates: list[Candidate]) -> None:
        """Give back the slots and entries of records done here (or abandoned)."""
        per_partition: dict[TopicPartition, int] = {}
        for candidate in candidates:
            record = candidate.record
            tp = TopicPartition(record.topic, record.partition)
            per_partition[tp] = per_partition.get(tp, 0) + 1
            self._inflight.remove(candidate.entry)
        for tp, count in per_partition.items():
            self._window.release_many(tp, count)
