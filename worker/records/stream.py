"""A decoupled model's request: its responses joined into one result, or published one by one.

``WORKER_STREAM_OUTPUT=final`` collects a request's responses until the final one
and publishes one result (outputs concatenated, ``x-response-count``); a retryable
failure retries the whole request, the partial responses discarded. ``each``
publishes every response as its own result, ``x-response-index`` and
``x-response-final`` telling its place: under at_least_once each one as soon as it
arrives (while the next ones keep coming), so once one is published the request is
never retried (that would publish its first pieces twice); under exactly_once they
are collected and go in the transaction that carries the record's offset, so a
``read_committed`` reader never sees part of a stream (and a retry is safe).

Deadlines: the first response within ``WORKER_REQUEST_TIMEOUT_MS``, each further one
within ``WORKER_STREAM_IDLE_TIMEOUT_MS`` of the one before, all of them within the
record's deadline. Responses held at once (``final``, or ``each`` under exactly_once)
are bounded by ``WORKER_MAX_OUTPUT_BYTES``; in ``each`` mode every response is also
checked on its own when it is encoded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from worker import errors, wire
from worker.delivery.base import Sink
from worker.flow.retry import Budget
from worker.kafka.types import ConsumerRecord
from worker.records.steps import Steps
from worker.settings import Settings, StreamOutput
from worker.triton.decoupled import is_final
from worker.triton.failover import FailoverStream
from worker.triton.pool import TritonPool
from worker.wire.headers import X_RESPONSES_PUBLISHED, X_RESPONSES_RECEIVED, Headers, Source
from worker.wire.streams import concat_responses, each_headers, final_headers, has_outputs

__all__ = ["StreamCalls", "StreamRules", "Streamed"]

Result = tuple[bytes, Headers]


@dataclass(frozen=True, slots=True)
class StreamRules:
    """What the settings say about decoupled models."""

    output: StreamOutput
    join_bytes: bool
    first_timeout_s: float
    idle_timeout_s: float
    max_output_bytes: int
    exactly_once: bool

    @classmethod
    def from_settings(cls, settings: Settings) -> StreamRules:
        return cls(
            output=settings.delivery.stream_output,
            join_bytes=settings.delivery.stream_join_bytes,
            first_timeout_s=settings.triton.request_timeout_ms / 1000,
            idle_timeout_s=settings.triton.stream_idle_timeout_ms / 1000,
            max_output_bytes=settings.limits.max_output_bytes,
            exactly_once=settings.delivery.delivery == "exactly_once",
        )


@dataclass(slots=True)
class _Origin:
    """What a result of the request needs besides its response."""

    request: wire.DecodedRequest
    source: Source
    record: ConsumerRecord[bytes, bytes]


class _Reader:
    """Reads one request's responses within its deadlines; observes the stream metrics."""

    def __init__(
        self, responses: FailoverStream, deadline: float, rules: StreamRules, metrics: Any
    ) -> None:
        self.responses = responses
        self.deadline = deadline
        self._rules = rules
        self._metrics = metrics  # (first response, gaps, responses per request) of the model
        self.received = 0  # responses read (an error response is not one)
        self.with_outputs = 0

    async def next(self) -> Any:
        """The next response (None after the final one); WorkerError when the stream fails."""
        rules, responses = self._rules, self.responses
        first = self.received == 0
        if first:
            bound_s, setting, since = rules.first_timeout_s, "REQUEST", responses.sent_at
        else:
            bound_s, setting, since = rules.idle_timeout_s, "STREAM_IDLE", responses.last_arrival
        if since + bound_s < self.deadline:
            deadline = since + bound_s
            late = (
                f"no {'first' if first else 'next'} response from Triton within "
                f"{bound_s * 1000:.0f} ms (WORKER_{setting}_TIMEOUT_MS)"
            )
        else:
            deadline, late = self.deadline, "the record's deadline passed while streaming"
        previous = responses.last_arrival
        response = await responses.next(deadline, late)
        if response is not None:
            self._metrics[0 if first else 1].observe(max(0.0, responses.last_arrival - previous))
            self.received += 1
            self.with_outputs += has_outputs(response)
        return response

    def complete(self) -> None:
        """The final response was read: count the stream's responses."""
        self._metrics[2].observe(self.with_outputs)

    def failed(self, error: errors.WorkerError, published: int | None = None) -> errors.WorkerError:
        """``error`` with the stream's facts (and, once results went out, why no retry)."""
        if published:
            error = type(error)(
                f"{error.message}; not retried: {published} result(s) of the stream were "
                "already published (a retry would publish them again)"
            )
        facts = [(X_RESPONSES_RECEIVED, str(self.received).encode())]
        if published is not None:
            facts.append((X_RESPONSES_PUBLISHED, str(published).encode()))
        error.facts = tuple(facts)
        return error


@dataclass(slots=True)
class _Live:
    """A stream whose first response has arrived; the rest is relayed as it comes."""

    reader: _Reader
    first: Any


@dataclass(slots=True)
class Streamed:
    """A decoupled request's outcome: its results, or a live stream to relay (each mode)."""

    origin: _Origin
    results: list[Result] = field(default_factory=list)
    live: _Live | None = None
    model_version: str = ""
    attempts: int = 0
    published: int = 0


class StreamCalls:
    """Decoupled requests of one worker: sent on the pool, retried by the retrier."""

    def __init__(self, rules: StreamRules, pool: TritonPool, steps: Steps) -> None:
        """``steps``: the retries, the results' encoding, the metrics."""
        self.rules = rules
        self._pool = pool
        self._retrier = steps.retrier
        self._steps = steps

    async def evaluate(
        self,
        request: wire.DecodedRequest,
        budget: Budget,
        record: ConsumerRecord[bytes, bytes],
        source: Source,
    ) -> Streamed:
        """Send the record's request (retrying as the rules allow); its results, or its live
        stream."""
        streamed = Streamed(_Origin(request, source, record))
        model = (request.model_name, request.model_version)
        if self.rules.output == "each" and not self.rules.exactly_once:

            async def first(timeout_s: float) -> _Live:
                streamed.attempts += 1
                return await self._open(request, time.monotonic() + timeout_s)

            streamed.live = await self._retrier.run(model, budget, first)
            streamed.model_version = streamed.live.first.model_version
            return streamed

        async def collect(timeout_s: float) -> list[Any]:
            streamed.attempts += 1
            return await self._collect(request, time.monotonic() + timeout_s)

        responses = await self._retrier.run(model, budget, collect)
        streamed.model_version = responses[-1].model_version
        if self.rules.output == "final":
            merged = concat_responses(responses, join_bytes=self.rules.join_bytes)
            count = sum(1 for response in responses if has_outputs(response))
            streamed.results = [self._result(streamed.origin, merged, final_headers(count))]
        else:
            last = len(responses) - 1
            streamed.results = [
                self._result(streamed.origin, response, each_headers(i, i == last, last + 1))
                for i, response in enumerate(responses)
            ]
        return streamed

    def _reader(self, request: wire.DecodedRequest, deadline: float) -> _Reader:
        responses = self._pool.infer_stream(request.infer_request)
        return _Reader(
            responses, deadline, self.rules, self._steps.stream_metrics(request.model_name)
        )

    async def _collect(self, request: wire.DecodedRequest, deadline: float) -> list[Any]:
        """One try: every response until the final one, their outputs' total bounded."""
        reader = self._reader(request, deadline)
        collected: list[Any] = []
        size = 0
        try:
            while (response := await reader.next()) is not None:
                collected.append(response)
                size += sum(len(raw) for raw in response.raw_output_contents)
                if size > self.rules.max_output_bytes:
                    raise errors.OutputTooLarge(
                        f"responses of model {request.model_name!r} exceed "
                        f"{self.rules.max_output_bytes} bytes (WORKER_MAX_OUTPUT_BYTES) after "
                        f"{len(collected)} of them"
                    )
                if is_final(response):
                    break
        except errors.WorkerError as error:
            raise reader.failed(error) from None
        finally:
            reader.responses.close()
        reader.complete()
        return collected

    async def _open(self, request: wire.DecodedRequest, deadline: float) -> _Live:
        """One try of ``each`` mode: send, and wait for the first response."""
        reader = self._reader(request, deadline)
        try:
            first = await reader.next()
        except errors.WorkerError as error:
            reader.responses.close()
            raise reader.failed(error, 0) from None
        except BaseException:
            reader.responses.close()
            raise
        return _Live(reader, first)

    def _result(self, origin: _Origin, response: Any, extra: Sequence[tuple[str, bytes]]) -> Result:
        return self._steps.encode(origin.request, response, origin.record, origin.source, extra)

    # -- publication ------------------------------------------------------------------

    async def publish(
        self, streamed: Streamed, record: ConsumerRecord[bytes, bytes], sink: Sink
    ) -> None:
        """Publish the results, or relay the live stream; WorkerError if the stream fails
        (with x-responses-received and x-responses-published among its facts)."""
        if streamed.live is None:
            await sink.publish_results(record, streamed.results)
            self._published(streamed, len(streamed.results))
            return
        reader = streamed.live.reader
        try:
            await self._relay(streamed, streamed.live, record, sink)
        except errors.WorkerError as error:
            raise reader.failed(error, streamed.published) from None
        finally:
            reader.responses.close()

    async def _relay(
        self,
        streamed: Streamed,
        live: _Live,
        record: ConsumerRecord[bytes, bytes],
        sink: Sink,
    ) -> None:
        """Publish what has arrived, in order, while the next responses keep arriving."""
        reader = live.reader
        batch: list[Any] = [live.first]
        final = live.first is None or is_final(live.first)
        failure: errors.WorkerError | None = None
        while True:
            # Everything queued meanwhile goes out together: one batch, one ack to wait for.
            while not final and failure is None and reader.responses.queued():
                failure, final = await self._read_into(reader, batch)
            if batch:
                await self._publish_batch(streamed, record, sink, batch, final)
                batch = []
            if failure is not None:
                raise failure
            if final:
                reader.complete()
                return
            failure, final = await self._read_into(reader, batch)

    @staticmethod
    async def _read_into(
        reader: _Reader, batch: list[Any]
    ) -> tuple[errors.WorkerError | None, bool]:
        """Read one response into ``batch``: (the failure, if it failed; whether it is final)."""
        try:
            response = await reader.next()
        except errors.WorkerError as error:
            return error, False
        if response is None:
            return None, True
        batch.append(response)
        return None, is_final(response)

    async def _publish_batch(
        self,
        streamed: Streamed,
        record: ConsumerRecord[bytes, bytes],
        sink: Sink,
        batch: list[Any],
        final: bool,
    ) -> None:
        """Encode and publish ``batch``; one too large is refused after those before it."""
        results: list[Result] = []
        too_large: errors.WorkerError | None = None
        last = len(batch) - 1
        for offset, response in enumerate(batch):
            index = streamed.published + offset
            is_last = final and offset == last
            try:
                extra = each_headers(index, is_last, index + 1)
                results.append(self._result(streamed.origin, response, extra))
            except errors.WorkerError as error:
                too_large = error
                break
        if results:
            await sink.publish_results(record, results)
            self._published(streamed, len(results))
        if too_large is not None:
            raise too_large

    def _published(self, streamed: Streamed, count: int) -> None:
        streamed.published += count
        self._steps.published(streamed.origin.request.model_name, count)
