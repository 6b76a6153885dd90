"""The per-record path: one record in a task of its own, decoded, inferred, published, done.

Every record ends in exactly one of: a result (for a decoupled model in ``each``
mode, an ordered series of them), or a dead letter. ``evaluate`` computes it, with
retries, holds, ordering turns, decoupled streams and sequences; ``deliver``
publishes it through the delivery mode's sink and returns once the broker has
acknowledged it (or the transaction holding it has committed); ``run`` is the
record's task around both, and has the delivery mode mark it done only then.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from worker import errors, wire
from worker.delivery.base import Delivery
from worker.flow.ordering import Ticket
from worker.flow.retry import Budget
from worker.flow.window import Window
from worker.kafka.types import ConsumerRecord, TopicPartition
from worker.observability import InFlightRegistry
from worker.observability.inflight import DETACHED, InFlight
from worker.observability.tracing import Tracing
from worker.records.outcome import Outcome
from worker.records.steps import Steps
from worker.records.stream import StreamCalls
from worker.triton.batching import MicroBatcher
from worker.triton.pool import TritonPool
from worker.wire import Source
from worker.wire.sequences import apply_sequence
from worker.wire.validation import ModelSpec

__all__ = ["SinglePath"]


#: Exceptions that are not a record's failure: they end the record's task as they are.
_CONTROL_FLOW = (errors.Fatal, errors.PartitionRevoked)


class SinglePath:
    """Turns a consumed record into a published result or dead letter, in its own task."""

    def __init__(
        self,
        steps: Steps,
        *,
        pool: TritonPool,
        batcher: MicroBatcher,
        streams: StreamCalls,
        delivery: Delivery,
        window: Window,
        inflight: InFlightRegistry,
        tracing: Tracing,
        key_mode: bool,
    ) -> None:
        """``key_mode``: records of a key are answered in offset order (ordering ``key``)."""
        self._steps = steps
        self._pool = pool
        self._batcher = batcher
        self._streams = streams
        self._delivery = delivery
        self._sink = delivery.sink
        self._window = window
        self._inflight = inflight
        self._tracing = tracing
        self._key_mode = key_mode

    async def run(
        self,
        record: ConsumerRecord[bytes, bytes],
        ticket: int,
        key_turn: Ticket | None,
        publish_turn: Ticket | None,
        evaluated: Outcome | None = None,
        entry: InFlight | None = None,
    ) -> None:
        """The record's task: its turns, ``evaluate`` (unless ``evaluated``), then the
        delivery mode's ``complete`` around ``deliver``. The record holds its window slot
        (and its in-flight ``entry``, made here unless given) until it ends.

        Never raises for the record's sake; a forced stop (cancelled) leaves it not done.
        """
        tp = TopicPartition(record.topic, record.partition)
        structlog.contextvars.bind_contextvars(
            topic=record.topic, partition=record.partition, offset=record.offset
        )
        if entry is None:
            entry = self._inflight.add(record)
        try:
            if key_turn is not None and self._key_mode:
                entry.state = "waiting_turn"
                await key_turn.wait()
            with self._tracing.consume(record):
                outcome = evaluated or await self.evaluate(
                    record, None if self._key_mode else key_turn, entry
                )
                if publish_turn is not None:
                    entry.state = "waiting_turn"
                    await publish_turn.wait()

                def safe() -> None:
                    # The outcome is acknowledged, or staged in offset order: the next record
                    # of the key or partition may go (exactly_once need not wait for commit).
                    entry.state = "waiting_commit"
                    for turn in (key_turn, publish_turn):
                        if turn is not None:
                            turn.done()

                entry.state = "publishing"
                await self._delivery.complete(record, ticket, lambda: self.deliver(outcome), safe)
        except errors.PartitionRevoked:
            pass  # the partition moved away; its next owner redoes the record
        except errors.Fatal:
            raise
        except Exception as exc:
            # A bug in the bookkeeping around the record: never a crash for every member
            # that takes the partition. The record stays uncommitted.
            self._steps.internal_failure(exc)
        finally:
            # Forced stop (cancelled) lands here too: the record is not done and
            # its offset is not committed.
            for turn in (key_turn, publish_turn):
                if turn is not None:
                    turn.done()
            self._window.release(tp)
            self._inflight.remove(entry)

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
        budget = Budget(outcome.started + self._steps.rules.retry.record_deadline_s, entry=entry)
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
        record, steps = outcome.record, self._steps
        if record.value is None and record.key is None:
            raise errors.DecodeError(
                "record has neither key nor value (both null); expected an inference request"
            )
        await steps.schemas_ready(record, budget)
        request = steps.decode(record.value, record.headers, outcome.source)
        outcome.request = request
        budget.entry.request_id, budget.entry.model = request.request_id, request.model_name
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        steps.allow(record.topic, request.model_name)
        spec = await steps.retrier.run(
            (request.model_name, request.model_version),
            budget,
            lambda _: self._pool.model_spec(request.model_name, request.model_version),
            inference=False,
        )
        steps.fit(spec, request)
        steps.check(spec, request)
        sequenced = spec.sequence and steps.rules.sequence_from_key
        if sequenced:
            apply_sequence(request, record.key, record.headers, string_ids=spec.string_sequence_ids)
        if turn is not None:
            await self._take_turn(turn, sequenced, budget)
        if spec.decoupled:
            with self._tracing.infer(request.model_name, request.model_version):
                outcome.streamed = await self._streams.evaluate(
                    request, budget, record, outcome.source
                )
            outcome.served_version = outcome.streamed.model_version
            return
        with self._tracing.infer(request.model_name, request.model_version):
            trace = self._tracing.to_triton(record.headers)
            response = await self._infer(request, spec, budget, trace)
        outcome.served_version = response.model_version
        outcome.value, outcome.headers = steps.encode(request, response, record, outcome.source)

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
        self._steps.internal(exc)
        self._fail(outcome, errors.InternalError.wrapping(exc), attempts)

    def _fail(self, outcome: Outcome, error: errors.WorkerError, attempts: int) -> None:
        record = outcome.record
        outcome.error, outcome.value = error, None
        outcome.headers = self._steps.dead_letter(record.headers, error, outcome.source, attempts)

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
                if isinstance(error, errors.OutputTooLarge) and streamed is None and outcome.value:
                    # The record the broker judged: the result with the request's key.
                    self._steps.refusals.refused(outcome.record.key, outcome.value, outcome.headers)
                self._fail(outcome, error, streamed.attempts if streamed is not None else 1)
            except _CONTROL_FLOW:
                raise
            except Exception as exc:
                self._internal(outcome, exc, 1)
        self._steps.outcome_reached(isinstance(outcome.error, errors.InternalError))
        if outcome.error is not None:
            await self._publish_dead_letter(outcome)
        await self._steps.ended(
            outcome.record,
            outcome.request,
            error=outcome.error,
            served_version=outcome.served_version,
            started=outcome.started,
            counted=streamed is not None,  # a stream's results are counted as they go out
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
            outcome.error, outcome.headers = self._steps.plain_dead_letter(exc, outcome.source)
        try:
            await self._sink.publish_dead_letter(record, outcome.headers)
        except _CONTROL_FLOW:
            raise
        except Exception as exc:
            raise errors.WriteFailed(
                f"dead letter of {outcome.source} cannot be written: {type(exc).__name__}: {exc}"
            ) from exc

    async def _infer(
        self, request: wire.DecodedRequest, spec: ModelSpec, budget: Budget, trace: Any
    ) -> Any:
        steps, try_timeout_s = self._steps, self._steps.rules.retry.try_timeout_s

        async def once(timeout_s: float) -> Any:
            started = time.monotonic()
            try:
                response = await self._batcher.infer(
                    request, spec, min(timeout_s, try_timeout_s), trace, budget.entry
                )
            except (errors.TritonOverloaded, errors.TritonTimeout) as exc:
                steps.overloaded(exc)
                raise
            steps.inferred(request.model_name, time.monotonic() - started)
            return response

        return await steps.retrier.run((request.model_name, request.model_version), budget, once)
