"""The batch path (the fast path): the plain records of one dispatch pass together, no task each.

A record qualifies when nothing asks for the per-record path (see ``select``): it
decodes and validates, its model's spec is cached, the request may share a
Triton request with others, the model is neither held (reloading) nor failing
(its failure-rate breaker), and no unary trace call is asked for. It is the path of
every delivery mode and ordering, with audit and spans on or off; only
``WORKER_FAST_PATH=false`` turns it off.

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
with the record. Under exactly_once a group gives its slots and entries back once its
results are staged (within the staged bound); a result its transaction refuses after
that takes a slot (over the limit if need be) and an entry again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import structlog

from worker import errors, wire
from worker.delivery.base import Delivery, Then
from worker.flow.ordering import Ticket, Turns, wait_all
from worker.flow.window import Window
from worker.kafka.types import ConsumerRecord, TopicPartition
from worker.observability import InFlight, InFlightRegistry
from worker.observability.inflight import State
from worker.observability.trace_context import GroupSpan
from worker.observability.tracing import Tracing
from worker.records.admission import Admissions
from worker.records.outcome import Handed, HandOver, Outcome
from worker.records.steps import Steps
from worker.triton.batching import batch_key
from worker.triton.merging import merge, split
from worker.triton.pool import TritonPool
from worker.wire import Source
from worker.wire.batch_results import BatchResults
from worker.wire.requests import pack_group
from worker.wire.validation import ModelSpec

__all__ = ["BatchPath", "Candidate", "Group"]


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
    released: bool = False  # its slot and entry given back
    #: Its ordering unit (its partition, or its partition and key; see ``dispatch._Groups``):
    #: its group publishes the unit's records in offset order, once the unit's turn comes.
    unit: Hashable | None = None
    #: When (``time.monotonic()``) its micro-batch was sent, and answered (for its spans).
    sent: float = 0.0
    answered: float = 0.0

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.record.topic, self.record.partition)


@dataclass(slots=True)
class Group:
    """Candidates answered together, in dispatch order (see ``dispatch._Groups``), with one
    turn per ordering unit, taken when the unit's first record joined: the unit's records
    publish together, in offset order, once the turn comes."""

    candidates: list[Candidate] = field(default_factory=list)
    turns: dict[Hashable, Ticket] = field(default_factory=dict)


@dataclass(slots=True)
class _Ready:
    """A result ready to go out: its candidate, value, headers and served version."""

    candidate: Candidate
    value: bytes
    headers: list[tuple[str, bytes | None]]
    served: str

    def outcome(self) -> Outcome:
        """The result as an outcome the per-record path only has to publish."""
        candidate = self.candidate
        outcome = Outcome(candidate.record, candidate.source, candidate.started, candidate.request)
        outcome.value, outcome.headers, outcome.served_version = (
            self.value,
            self.headers,
            self.served,
        )
        return outcome


@dataclass(slots=True)
class _Failed:
    """A candidate for the per-record path: why, and its outcome when it has one."""

    candidate: Candidate
    reason: str
    outcome: Outcome | None = None


#: A record's result: its value and headers, the served version.
_Result = tuple[bytes, list[tuple[str, bytes | None]], str]


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
            request = steps.decode(value, record.headers, source, defer=True)
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
        entry = self._entry(record, request, "waiting_batch")
        if request.pending is not None:
            rows = request.pending[0].shape[0]
        else:
            rows = int(request.infer_request.inputs[0].shape[0])
        return Candidate(record, generation, source, request, spec, rows, entry, time.monotonic())

    async def run(self, group: Group, hand_over: HandOver) -> None:
        """Answer the group; what fails goes to the per-record path by ``hand_over``.
        Never raises for a record's sake; a forced stop (cancelled) leaves the records
        not done. Every turn the group holds is given back, or handed on."""
        candidates, passed = group.candidates, set[Hashable]()
        try:
            await self._run(group, hand_over, passed)
        except errors.Fatal:
            raise
        except Exception as exc:
            # A bug in the group's bookkeeping: the records not done yet get a second
            # chance, each on its own (their results may appear twice: at least once).
            structlog.contextvars.bind_contextvars(records=len(candidates))
            failed = [_Failed(c, "internal") for c in candidates if not c.settled]
            self._hand_over(group, failed, hand_over, passed)
            self._steps.internal_failure(exc)
        finally:
            for unit, turn in group.turns.items():
                if unit not in passed:
                    turn.done()
            self._release([c for c in candidates if not c.settled])

    async def _run(self, group: Group, hand_over: HandOver, passed: set[Hashable]) -> None:
        ready, failed = await self._answers(group.candidates)
        # A unit's records after its first failed one cannot be published before it: they
        # join it on the per-record path. Those of no unit go at once.
        ready, failed = _cut_at_failures(ready, failed)
        self._hand_over(group, [f for f in failed if f.candidate.unit is None], hand_over, passed)
        failed = [f for f in failed if f.candidate.unit is not None]
        cut = {f.candidate.unit for f in failed}
        if group.turns:
            # Micro-batches are made per model and input signature: a unit's results are
            # put back in offset order, the order they are published in.
            ready.sort(key=_offset)
        # The units' earlier records are published first (the models of the group path keep
        # no state: inference may run ahead).
        await wait_all(group.turns.values())
        if ready:
            await self._complete(group, ready, cut, hand_over, passed)
        self._hand_over(group, failed, hand_over, passed)

    async def _answers(self, candidates: list[Candidate]) -> tuple[list[_Ready], list[_Failed]]:
        """The candidates' micro-batches inferred: each one's result, or why it has none."""
        batches = self._micro_batches(candidates)
        if len(batches) == 1:
            answers = [await self._infer(batches[0])]
        else:
            answers = await asyncio.gather(*(self._infer(batch) for batch in batches))
        ready: list[_Ready] = []
        failed: list[_Failed] = []
        for batch, response in zip(batches, answers, strict=True):
            if isinstance(response, _Undecodable):
                for i, candidate in enumerate(batch):
                    if i in response.indexes:
                        failed.append(_Failed(candidate, "decode"))
                batch = [c for i, c in enumerate(batch) if i not in response.indexes]
                response = response.response
            results = None if response is None else self._results(batch, response)
            if results is None:
                failed += [_Failed(c, "inference") for c in batch]
                continue
            for candidate, result in zip(batch, results, strict=True):
                if result is None:
                    failed.append(_Failed(candidate, "encode"))
                    continue
                candidate.entry.state = "publishing"
                ready.append(_Ready(candidate, *result))
        return ready, failed

    async def _complete(
        self,
        group: Group,
        ready: list[_Ready],
        cut: set[Hashable],
        hand_over: HandOver,
        passed: set[Hashable],
    ) -> None:
        """Publish the results through the delivery mode; count those done."""

        def safe() -> None:
            # Each unit's next records may go: the results are safe (enqueued on the
            # idempotent producer, which writes them in that order, or staged in order in
            # the transaction); a unit with records handed over (``cut``) keeps its turn
            # until they are.
            for unit, turn in group.turns.items():
                if unit not in cut:
                    turn.done()

        def refused(index: int, error: BaseException) -> None:
            # At once: under exactly_once the group's other results wait for this one's
            # dead letter (its partition commits below it until then).
            item = ready[index]
            if isinstance(error, errors.PartitionRevoked):
                item.candidate.settled = True  # its next owner redoes it
                return
            if item.candidate.released:
                self._retake(item.candidate)
            handed = [_Failed(item.candidate, "publish", item.outcome())]
            self._hand_over(group, handed, hand_over, passed, turns=False)

        await self._delivery.complete_many(
            [(r.candidate.record, r.value, r.headers) for r in ready],
            [r.candidate.generation for r in ready],
            on_safe=safe,
            on_refused=refused,
            then=self._auditing(ready) if self._steps.audits else None,
        )
        self._settle(ready)

    def _auditing(self, ready: list[_Ready]) -> Then:
        async def audit(indexes: list[int]) -> None:
            await self._steps.audit_many(
                [
                    (r.candidate.record, r.candidate.request, r.served, r.candidate.started)
                    for r in (ready[i] for i in indexes)
                ]
            )

        return audit

    def _settle(self, ready: list[_Ready]) -> None:
        """Count the records done (delivery marked them; those refused were handed over)."""
        finished: list[Candidate] = []
        for item in ready:
            candidate = item.candidate
            if not candidate.settled:
                candidate.settled = True
                finished.append(candidate)
        self._steps.published_many(finished)
        if self._tracing.enabled:
            published = time.monotonic()
            self._tracing.group_spans(
                [
                    GroupSpan(
                        c.record,
                        c.request.model_name,
                        c.request.model_version,
                        c.started,
                        c.sent,
                        c.answered,
                        published,
                    )
                    for c in finished
                ]
            )
        # Their slots and entries go now (the caller's finally sees them settled).
        self._release(finished)

    def _micro_batches(self, candidates: list[Candidate]) -> list[list[Candidate]]:
        """Candidates grouped by batch key, cut at each model's row capacity, in order."""
        batches: list[list[Candidate]] = []
        open_batches: dict[tuple[object, ...], tuple[list[Candidate], int]] = {}
        for candidate in candidates:
            key = _group_key(candidate.request)
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

    async def _infer(self, batch: list[Candidate]) -> Any:
        """The batch's response (to its candidates merged); None when the batch failed;
        ``_Undecodable`` when some of its pending tensors do not build (the others' response
        within)."""
        if batch[0].request.pending is not None:
            merged, bad = pack_group([c.request for c in batch])
            if bad:
                rest = [c for i, c in enumerate(batch) if i not in bad]
                return _Undecodable(set(bad), await self._infer(rest) if rest else None)
        else:
            requests = [c.request.infer_request for c in batch]
            merged = requests[0] if len(batch) == 1 else merge(requests)
        for candidate in batch:
            candidate.entry.state = "sent"
        started = time.monotonic()
        try:
            response = await self._pool.infer(merged, self._timeout_s)
        except Exception as exc:
            # Outages and failures are seen by the breakers through the per-record path;
            # an overload lowers the limit once here (the per-record path tells the rest).
            self._steps.overloaded(exc)
            return None
        answered = time.monotonic()
        for candidate in batch:
            candidate.sent, candidate.answered = started, answered
        request = batch[0].request
        self._steps.inferred_many(
            (request.model_name, request.model_version), answered - started, len(batch)
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
            made = wire.ResultHeaders(batch[0].request.model_name, served)
            for i, c in enumerate(batch):
                try:
                    value, headers = steps.encode_row(
                        together, i, c.rows, c.request, c.record, c.source, headers=made
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
        group: Group,
        failed: list[_Failed],
        hand_over: HandOver,
        passed: set[Hashable],
        *,
        turns: bool = True,
    ) -> None:
        """Give the records (their slots and entries: their age goes on) to the per-record
        path. With ``turns``, each unit's records go in offset order, each after the one
        before it, and the group's turn of the unit is given back once the last of them is
        safe. A result the broker refused goes without a turn: its group's turn was given
        back when it was sent."""
        chains: dict[Hashable, Turns] = {}
        for item in failed:
            candidate = item.candidate
            candidate.settled = True
            if item.outcome is None:
                candidate.entry.state = "decoding"  # it starts over
            publish_turn = None
            unit = candidate.unit
            if turns and unit is not None and unit in group.turns:
                chain = chains.get(unit)
                if chain is None:
                    chain = chains[unit] = Turns()
                publish_turn = chain.ticket(unit)
            hand_over(
                Handed(
                    candidate.record,
                    candidate.generation,
                    item.outcome,
                    candidate.entry,
                    publish_turn,
                )
            )
            self._fallbacks[item.reason].inc()
        for unit, chain in chains.items():
            passed.add(unit)
            chain.ticket(unit).then(group.turns[unit].done)

    def _retake(self, candidate: Candidate) -> None:
        """A slot and an entry again, for a record refused after its group gave them back
        (exactly_once gives them back once a result is staged): the per-record path takes
        it on with both."""
        self._window.take(candidate.tp)
        candidate.entry = self._entry(candidate.record, candidate.request, "publishing")
        candidate.released = False

    def _entry(
        self, record: ConsumerRecord[bytes, bytes], request: wire.DecodedRequest, state: State
    ) -> InFlight:
        """The record's in-flight entry, named by its request."""
        entry = self._inflight.add(record)
        entry.request_id, entry.model, entry.state = request.request_id, request.model_name, state
        return entry

    def _release(self, candidates: list[Candidate]) -> None:
        """Give back the slots and entries of records done here (or abandoned)."""
        per_partition: dict[TopicPartition, int] = {}
        for candidate in candidates:
            candidate.released = True
            record = candidate.record
            tp = TopicPartition(record.topic, record.partition)
            per_partition[tp] = per_partition.get(tp, 0) + 1
            self._inflight.remove(candidate.entry)
        for tp, count in per_partition.items():
            self._window.release_many(tp, count)


@dataclass(slots=True)
class _Undecodable:
    """A micro-batch some of whose pending tensors do not build: their indexes, and the
    response to the others (None: there were none, or it failed)."""

    indexes: set[int]
    response: Any


def _group_key(request: wire.DecodedRequest) -> tuple[object, ...]:
    """``batch_key`` of the request; for pending tensors, from them (pending requests only
    batch with one another: the group builds their tensors at once)."""
    pending = request.pending
    if pending is None:
        return batch_key(request.infer_request)
    inputs = tuple((p.name, p.datatype, p.shape[1:]) for p in pending)
    return ("pending", request.model_name, request.model_version, inputs, request.output_names)


def _offset(item: _Ready) -> int:
    offset: int = item.candidate.record.offset
    return offset


def _cut_at_failures(
    ready: list[_Ready], failed: list[_Failed]
) -> tuple[list[_Ready], list[_Failed]]:
    """A unit's records after its first failed one, taken from ``ready`` into ``failed``
    (to be handed over after it, in offset order)."""
    first_failed: dict[Hashable, int] = {}
    for gone in failed:
        unit, offset = gone.candidate.unit, gone.candidate.record.offset
        if unit is not None:
            first_failed[unit] = min(first_failed.get(unit, offset), offset)
    if not first_failed:
        return ready, failed
    kept: list[_Ready] = []
    for item in ready:
        candidate = item.candidate
        cut = first_failed.get(candidate.unit)
        if cut is not None and candidate.record.offset > cut:
            failed.append(_Failed(candidate, "order", item.outcome()))
        else:
            kept.append(item)
    failed.sort(key=lambda f: (f.candidate.tp, f.candidate.record.offset))
    return kept, failed
