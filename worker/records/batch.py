"""The batch path (the fast path): the plain records of one dispatch pass together, no task each.

A record qualifies when nothing asks for the per-record path (see ``select``): it
decodes and validates, its model's spec is cached, the request may share a
Triton request with others, the model is neither held (reloading) nor failing
(its failure-rate breaker), and no unary trace call is asked for. The dispatcher
builds this path only when the delivery mode takes batches, ordering is
``unordered``, audit is off and no spans are asked for (see ``worker.records.dispatch``).

The qualifying records of one dispatch pass are grouped by batch key into micro-batches
of at most min(WORKER_BATCH_MAX_SIZE, the model's max_batch_size) rows; each is merged
and sent with one ``TritonPool.infer`` (all concurrently, within the per-try timeout),
and each record's result encoded from the batched response (JSON and binary results cut
from it by rows, ``worker.wire.batch_results``; protobuf ones from it split into one
response per record). The delivery mode completes the results together
(``complete_many``: every send enqueued, then the acks awaited, then the acknowledged
records marked done, per partition at once), and the steps count them once per group
where the metric allows.

Anything that goes wrong hands the record to the per-record path, which then
handles it from the start with its retries, bisection, holds and breakers:
every record of a micro-batch that failed (any error: a batch try is not
counted as an attempt, so a poison pill costs one extra Triton call), a result
that fails to encode, a result whose send failed (written again alone, with its
retries and size handling). The slot in the window and the in-flight entry pass
with the record.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import structlog

from worker import errors, wire
from worker.delivery.base import Delivery
from worker.flow.window import Window
from worker.kafka.types import ConsumerRecord, TopicPartition
from worker.observability import InFlight, InFlightRegistry
from worker.observability.tracing import Tracing
from worker.records.admission import Admissions
from worker.records.outcome import HandOver, Outcome
from worker.records.steps import Steps
from worker.triton.batching import batch_key
from worker.triton.merging import merge, split
from worker.triton.pool import TritonPool
from worker.wire import Source
from worker.wire.batch_results import BatchResults
from worker.wire.validation import ModelSpec

__all__ = ["BatchPath", "Candidate"]


@dataclass(slots=True)
class Candidate:
    """A record taken by the batch path: decoded, validated, its slot and entry held."""

    record: ConsumerRecord[bytes, bytes]
    generation: int
    source: Source
    request: wire.DecodedRequest
    spec: ModelSpec
    rows: int
    entry: InFlight
    started: float
    settled: bool = False  # done, or handed to the per-record path


#: A record's result: its value and headers, the served version.
_Result = tuple[bytes, list[tuple[str, bytes | None]], str]
#: A result ready to go out: the candidate, its value and headers, the served version.
_Ready = tuple[Candidate, bytes, list[tuple[str, bytes | None]], str]


class BatchPath:
    """Decodes, infers and completes a group of records together."""

    def __init__(
        self,
        steps: Steps,
        *,
        pool: TritonPool,
        delivery: Delivery,
        window: Window,
        inflight: InFlightRegistry,
        tracing: Tracing,
        batch_max_size: int,
    ) -> None:
        """``delivery``: a mode that takes batches (``complete_many``)."""
        assert delivery.takes_batches, "the batch path needs a delivery mode that takes batches"
        self._steps = steps
        self._pool = pool
        self._delivery = delivery
        self._window = window
        self._inflight = inflight
        self._tracing = tracing
        self._max_rows = batch_max_size
        retry = steps.rules.retry
        self._timeout_s = min(retry.try_timeout_s, retry.record_deadline_s)
        self._fallbacks = steps.fallback_counters()
        self._admissions = Admissions(steps.check)

    @property
    def open(self) -> bool:
        """False while the circuit breaker is open (an outage: the per-record path waits)."""
        return not self._steps.outage

    def select(self, record: ConsumerRecord[bytes, bytes], generation: int) -> Candidate | None:
        """The record as a candidate, or None when it needs the per-record path.

        Synchronous: decoding and validation happen here, once. A record that fails
        them goes to the per-record path, which decodes it again and dead-letters it.
        """
        value = record.value
        if value is None:
            return None
        steps, source = self._steps, Source.of(record)
        try:
            request = steps.decode(value, record.headers, source)
            name, version = request.model_name, request.model_version
            spec = self._pool.cached_spec(name, version)
            if spec is None or spec.decoupled or spec.sequence:
                return None
            if not steps.serving(name, version):
                return None
            if self._pool.trace_unary and self._tracing.to_triton(record.headers):
                return None  # its own unary call, carrying its trace context
            steps.allow(record.topic, name)
            steps.fit(spec, request)
            if not self._admissions.admits(spec, request):
                return None
        except Exception:
            return None
        entry = self._inflight.add(record)
        entry.request_id, entry.model, entry.state = request.request_id, name, "waiting_batch"
        rows = int(request.infer_request.inputs[0].shape[0])
        return Candidate(record, generation, source, request, spec, rows, entry, time.monotonic())

    async def run(self, candidates: list[Candidate], hand_over: HandOver) -> None:
        """Answer the candidates; what fails goes to the per-record path by ``hand_over``.
        Never raises for a record's sake; a forced stop (cancelled) leaves the records
        not done."""
        try:
            await self._run(candidates, hand_over)
        except errors.Fatal:
            raise
        except Exception as exc:
            # A bug in the group's bookkeeping: the records not done yet get a second
            # chance, each on its own (their results may appear twice: at least once).
            structlog.contextvars.bind_contextvars(records=len(candidates))
            self._hand_over([c for c in candidates if not c.settled], "internal", hand_over)
            self._steps.internal_failure(exc)
        finally:
            self._release([c for c in candidates if not c.settled])

    async def _run(self, candidates: list[Candidate], hand_over: HandOver) -> None:
        batches = self._micro_batches(candidates)
        if len(batches) == 1:
            answers = [await self._infer(batches[0])]
        else:
            answers = await asyncio.gather(*(self._infer(batch) for batch in batches))
        ready: list[_Ready] = []
        for batch, response in zip(batches, answers, strict=True):
            results = None if response is None else self._results(batch, response)
            if results is None:
                self._hand_over(batch, "inference", hand_over)
                continue
            for candidate, result in zip(batch, results, strict=True):
                if result is None:
                    self._hand_over([candidate], "encode", hand_over)
                    continue
                candidate.entry.state = "publishing"
                ready.append((candidate, *result))
        if ready:
            acks = await self._delivery.complete_many(
                [(c.record, v, h) for c, v, h, _ in ready], [item[0].generation for item in ready]
            )
            self._settle(ready, acks, hand_over)

    def _settle(
        self, ready: list[_Ready], acks: list[BaseException | None], hand_over: HandOver
    ) -> None:
        """Count the records done (delivery marked them), hand over those refused."""
        finished: list[Candidate] = []
        for (candidate, value, headers, served), ack in zip(ready, acks, strict=True):
            if ack is not None:
                record = candidate.record
                outcome = Outcome(record, candidate.source, candidate.started, candidate.request)
                outcome.value, outcome.headers, outcome.served_version = value, headers, served
                self._hand_over([candidate], "publish", hand_over, outcome)
                continue
            candidate.settled = True
            finished.append(candidate)
        self._steps.published_many(finished)
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

    async def _infer(self, batch: list[Candidate]) -> Any | None:
        """The batch's response (to its candidates merged); None when the batch failed."""
        for candidate in batch:
            candidate.entry.state = "sent"
        requests = [c.request.infer_request for c in batch]
        started = time.monotonic()
        try:
            merged = requests[0] if len(batch) == 1 else merge(requests)
            response = await self._pool.infer(merged, self._timeout_s)
        except Exception as exc:
            # Outages and failures are seen by the breakers through the per-record path;
            # an overload lowers the limit once here (the per-record path tells the rest).
            self._steps.overloaded(exc)
            return None
        request = batch[0].request
        self._steps.inferred_many(
            (request.model_name, request.model_version), time.monotonic() - started, len(batch)
        )
        return response

    def _results(self, batch: list[Candidate], response: Any) -> list[_Result | None] | None:
        """Each candidate's result (value, headers, served version), None for one that does
        not encode; None for all when the response does not split into the batch's rows.

        A batch of JSON or binary requests and mapped events is encoded from the batched
        response at once (``BatchResults``); any other is split into one response per
        candidate first.
        """
        steps, rows = self._steps, [c.rows for c in batch]
        together = None
        if len(batch) > 1 and all(c.request.encoding != "protobuf" for c in batch):
            together = BatchResults.of(response, rows)
        results: list[_Result | None] = []
        if together is not None:
            served = together.model_version
            for i, c in enumerate(batch):
                try:
                    value, headers = steps.encode_row(
                        together, i, c.rows, c.request, c.record, c.source
                    )
                    results.append((value, headers, served))
                except Exception:  # OUTPUT_TOO_LARGE, or a bug: the per-record path says which
                    results.append(None)
            return results
        try:
            parts = [response] if len(batch) == 1 else split(response, rows, sum(rows))
        except Exception:  # the response does not split: the per-record path says why
            return None
        for c, part in zip(batch, parts, strict=True):
            try:
                value, headers = steps.encode(c.request, part, c.record, c.source)
                results.append((value, headers, part.model_version))
            except Exception:
                results.append(None)
        return results

    def _hand_over(
        self,
        candidates: list[Candidate],
        reason: str,
        hand_over: HandOver,
        outcome: Outcome | None = None,
    ) -> None:
        """Give the records (their slots and entries: their age goes on) to the per-record
        path."""
        for candidate in candidates:
            candidate.settled = True
            if outcome is None:
                candidate.entry.state = "decoding"  # it starts over
            hand_over(candidate.record, candidate.generation, outcome, candidate.entry)
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
