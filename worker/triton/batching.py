"""Client-side micro-batching: coalesce compatible requests into one Triton request.

Triton's per-request overhead dominates small models (rows per second grow
about 14x when 32 rows travel in one request), so requests for a batching
model (``max_batch_size > 0``) that agree on everything but their rows are
joined along the batch dimension, sent once, and the response is split back.

Compatible means: same model and version, same inputs (names, datatypes,
dimensions after the batch one), same requested outputs and request
parameters. Raw tensors are row-major with the batch dimension first, so
joining is byte concatenation, for BYTES too (each element carries its own
length prefix).

A batch that fails for good is split in halves and each half retried, down to
single requests, so one poison pill fails alone and its neighbours get their
results. A retryable failure (Triton down, overloaded, late) fails the whole
batch as retryable: the caller's retry loop sends the requests again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from worker import errors
from worker.observability.inflight import DETACHED, InFlight
from worker.triton.merging import merge as _merge
from worker.triton.merging import split as _split
from worker.triton.pool import TritonPool
from worker.wire import DecodedRequest
from worker.wire.validation import ModelSpec

__all__ = ["BatchStats", "MicroBatcher", "batch_key", "batchable"]

#: Request parameters that tie a request to server-side state: never batched.
_STATEFUL_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end"})
#: Entries of one batch whose deadlines differ by less than this share the batch's.
_DEADLINE_SLACK_S = 0.005


def batchable(spec: ModelSpec, request: DecodedRequest) -> bool:
    """True when ``request`` may share a Triton request with others for model ``spec``.

    The model must batch, every input must carry raw contents with the same
    batch dimension, and nothing may refer to per-request server state
    (sequence ids, shared-memory regions given as input parameters). Requests to
    decoupled models and to models with a sequence batcher never are.
    """
    if spec.max_batch_size <= 0 or spec.decoupled or spec.sequence:
        return False
    if any(t.is_shape_tensor for t in spec.inputs):
        return False
    infer = request.infer_request
    inputs = infer.inputs
    if not inputs or len(infer.raw_input_contents) != len(inputs):
        return False
    if _STATEFUL_PARAMETERS.intersection(infer.parameters.keys()):
        return False
    rows = None
    for tensor in inputs:
        if len(tensor.shape) < 1 or len(tensor.parameters) > 0:
            return False
        if rows is None:
            rows = tensor.shape[0]
        elif tensor.shape[0] != rows:
            return False
    return rows is not None and rows >= 1


def batch_key(infer: Any) -> tuple[object, ...]:
    """What two requests must share to travel in one batch."""
    inputs = tuple((t.name, t.datatype, tuple(t.shape[1:])) for t in infer.inputs)
    outputs = tuple(o.SerializeToString(deterministic=True) for o in infer.outputs)
    params = (
        tuple(sorted((k, v.SerializeToString()) for k, v in infer.parameters.items()))
        if len(infer.parameters)
        else ()
    )
    return (infer.model_name, infer.model_version, inputs, outputs, params)


@dataclass(slots=True)
class _Entry:
    request: DecodedRequest
    rows: int
    deadline: float
    future: asyncio.Future[Any]
    inflight: InFlight


@dataclass(slots=True)
class _Pending:
    entries: list[_Entry] = field(default_factory=list)
    rows: int = 0
    capacity_rows: int = 1
    timer: asyncio.Handle | None = None


@dataclass(frozen=True, slots=True)
class BatchStats:
    """Counters since start: Triton requests sent for batches, and the rows they carried."""

    batches: int
    rows: int
    bisections: int


class MicroBatcher:
    """Coalesces compatible requests for up to ``delay_s`` or ``max_batch_size`` rows."""

    def __init__(self, pool: TritonPool, max_batch_size: int, delay_s: float) -> None:
        """Send batches on ``pool``; ``max_batch_size`` 1 sends every request alone."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self._pool = pool
        self._max_rows = max_batch_size
        self._delay_s = delay_s
        self._pending: dict[tuple[object, ...], _Pending] = {}
        # Sends in progress; each is cancelled by close() if still running.
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._batches = 0
        self._rows = 0
        self._bisections = 0

    @property
    def stats(self) -> BatchStats:
        """Batches sent so far (single requests sent alone are not counted)."""
        return BatchStats(self._batches, self._rows, self._bisections)

    async def infer(
        self,
        request: DecodedRequest,
        spec: ModelSpec,
        timeout_s: float,
        trace: tuple[tuple[str, str], ...] = (),
        inflight: InFlight = DETACHED,
    ) -> Any:
        """The response to ``request`` alone, though it may travel with others.

        Raises WorkerError like ``TritonPool.infer``. The request waits at most
        ``delay_s`` for company; a full batch leaves at once. ``trace``: the
        request's trace context, which goes with it when it travels alone (see
        ``TritonPool.infer``); a request given one goes alone when the pool sends
        traced requests as unary calls. A merged request carries no trace context.
        ``inflight`` (the record's entry) is told while the request waits for its batch.
        """
        if self._closed:
            raise errors.TritonUnavailable("the worker is shutting down")
        capacity = min(self._max_rows, spec.max_batch_size)
        if capacity <= 1 or not batchable(spec, request) or (trace and self._pool.trace_unary):
            return await self._pool.infer(request.infer_request, timeout_s, trace)
        rows = int(request.infer_request.inputs[0].shape[0])
        if rows >= capacity:
            return await self._pool.infer(request.infer_request, timeout_s, trace)
        loop = asyncio.get_running_loop()
        entry = _Entry(request, rows, time.monotonic() + timeout_s, loop.create_future(), inflight)
        inflight.state = "waiting_batch"
        self._enqueue(batch_key(request.infer_request), entry, capacity)
        # No timer per request: the batch's send enforces each entry's deadline
        # (see _send). Cancelling this await cancels the future, and a batch not
        # yet sent leaves it out.
        return await entry.future

    def _enqueue(self, key: tuple[object, ...], entry: _Entry, capacity: int) -> None:
        pending = self._pending.get(key)
        if pending is not None and pending.rows + entry.rows > capacity:
            self._flush(key)
            pending = None
        if pending is None:
            pending = _Pending(capacity_rows=capacity)
            self._pending[key] = pending
            loop = asyncio.get_running_loop()
            # delay 0 still lets requests decoded in the same loop turn join.
            pending.timer = (
                loop.call_later(self._delay_s, self._flush, key)
                if self._delay_s > 0
                else loop.call_soon(self._flush, key)
            )
        pending.entries.append(entry)
        pending.rows += entry.rows
        if pending.rows >= capacity:
            self._flush(key)

    def _flush(self, key: tuple[object, ...]) -> None:
        """Send what is pending under ``key`` (from a timer, or because it is full)."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return
        if pending.timer is not None:
            pending.timer.cancel()
        task = asyncio.get_running_loop().create_task(self._send(pending.entries))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, entries: Sequence[_Entry]) -> None:
        """Send ``entries`` as one request; on a permanent failure, bisect."""
        live = [e for e in entries if not e.future.done()]
        if not live:
            return
        for entry in live:
            entry.inflight.state = "sent"
        latest = max(e.deadline for e in live)
        timeout_s = max(0.001, latest - time.monotonic())
        # The batch waits for its latest deadline; entries due sooner get a timer
        # of their own (rare: entries of one batch were queued within delay_s).
        timers = [_deadline_timer(e) for e in live if e.deadline < latest - _DEADLINE_SLACK_S]
        try:
            await self._send_live(live, timeout_s)
        finally:
            for timer in timers:
                timer.cancel()

    async def _send_live(self, live: list[_Entry], timeout_s: float) -> None:
        try:
            if len(live) == 1:
                response = await self._pool.infer(live[0].request.infer_request, timeout_s)
                _resolve(live[0], response)
                return
            merged = _merge([e.request.infer_request for e in live])
            total_rows = sum(e.rows for e in live)
            response = await self._pool.infer(merged, timeout_s)
            self._batches += 1
            self._rows += total_rows
            parts = _split(response, [e.rows for e in live], total_rows)
        except errors.WorkerError as error:
            if error.retryable or len(live) == 1:
                for entry in live:
                    _fail(entry, error)
                return
            # Some request in the batch is bad: halve until it is alone.
            self._bisections += 1
            middle = len(live) // 2
            await asyncio.gather(self._send(live[:middle]), self._send(live[middle:]))
            return
        except asyncio.CancelledError:
            for entry in live:
                _fail(entry, errors.TritonUnavailable("the worker is shutting down"))
            raise
        except Exception as exc:  # an unexpected failure still reaches every caller
            for entry in live:
                if not entry.future.done():
                    entry.future.set_exception(exc)
            return
        for entry, part in zip(live, parts, strict=True):
            part.id = entry.request.infer_request.id
            _resolve(entry, part)

    async def close(self) -> None:
        """Fail what still waits for company, cancel sends in progress. Idempotent."""
        self._closed = True
        pending, self._pending = self._pending, {}
        for group in pending.values():
            if group.timer is not None:
                group.timer.cancel()
            for entry in group.entries:
                _fail(entry, errors.TritonUnavailable("the worker is shutting down"))
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


def _deadline_timer(entry: _Entry) -> asyncio.TimerHandle:
    """Fail ``entry`` with TritonTimeout at its own deadline if no response came by then."""

    def expire() -> None:
        _fail(entry, errors.TritonTimeout("no response from Triton within the deadline (batched)"))

    return asyncio.get_running_loop().call_at(_loop_time_of(entry.deadline), expire)


def _loop_time_of(monotonic_s: float) -> float:
    """The event loop's clock reading at ``time.monotonic()`` = ``monotonic_s``."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_s - time.monotonic())


def _resolve(entry: _Entry, response: Any) -> None:
    if not entry.future.done():
        entry.future.set_result(response)


def _fail(entry: _Entry, error: errors.WorkerError) -> None:
    # Each caller gets its own exception object: tracebacks are per task.
    if not entry.future.done():
        entry.future.set_exception(type(error)(error.message))
