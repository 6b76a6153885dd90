"""One ``ModelStreamInfer`` call: a queue of requests in, responses matched by id out.

Each stream is the bidirectional gRPC call that
``tritonclient.grpc.aio.InferenceServerClient.stream_infer`` opens; the worker feeds
it ready-made ``ModelInferRequest`` messages. A stream stays open until every
response it owes has arrived, then is cancelled, never half-closed: tritonserver
2.51 can crash when a client half-closes a stream, even an idle one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]
import structlog
from tritonclient.grpc import service_pb2

from worker import errors
from worker.triton import errors as triton_errors
from worker.triton.decoupled import ResponseStream

__all__ = ["Stream"]

log = structlog.get_logger(__name__)


class Stream:
    """One ModelStreamInfer call: a queue of requests in, responses matched by id out."""

    def __init__(self, stub: object, index: int, headers: Mapping[str, str]) -> None:
        self.index = index
        self._stub = stub
        self._metadata = tuple(headers.items())
        self._call: Any = None
        self._abandoned = False
        self._outbox: asyncio.Queue[service_pb2.ModelInferRequest | None] = asyncio.Queue()
        # Insertion-ordered: the first entry is the oldest request still owed.
        self.pending: dict[str, asyncio.Future[service_pb2.ModelInferResponse]] = {}
        self._sent_at: dict[str, float] = {}
        # Decoupled requests still owed responses (until their final one).
        self.streams: dict[str, ResponseStream] = {}
        self.broken: errors.WorkerError | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> service_pb2.ModelInferRequest:
        # A plain async iterator rather than an async generator: gRPC may still be
        # awaiting it when the call breaks, and a generator cannot be closed then.
        request = await self._outbox.get()
        if request is None:
            raise StopAsyncIteration
        return request

    async def run(self) -> None:
        """Read responses until the stream ends; then fail whatever is still owed."""
        call = self._stub.ModelStreamInfer(  # type: ignore[attr-defined]
            self, metadata=self._metadata or None
        )
        self._call = call
        try:
            async for response in call:
                self._deliver(response)
            self.broken = errors.TritonUnavailable("the inference stream was closed by Triton")
        except grpc.aio.AioRpcError as exc:
            self.broken = triton_errors.from_grpc(exc.code(), exc.details() or "")
            if not self.broken.retryable:
                self.broken = errors.TritonUnavailable(
                    f"the inference stream broke: {exc.details()}"
                )
        except asyncio.CancelledError:
            call.cancel()
            self.broken = errors.TritonUnavailable("the inference stream was cancelled")
            task = asyncio.current_task()
            if self._abandoned and task is not None and not task.cancelling():
                return  # close() abandoned the drained call; this task was not cancelled
            raise
        finally:
            self._fail_pending(self.broken or errors.TritonUnavailable("stream ended"))
            # End the request iterator so gRPC's task feeding it finishes too.
            self._outbox.put_nowait(None)

    def load(self) -> int:
        """Requests still owed a response: single ones and decoupled streams."""
        return len(self.pending) + len(self.streams)

    def oldest_age_s(self, now: float) -> float:
        """How long the oldest owed single response has been waiting (0 when none).

        Decoupled requests are left out: they are long by nature, and Triton
        answers other requests on the stream meanwhile.
        """
        for correlation in self.pending:
            return now - self._sent_at[correlation]
        return 0.0

    def _deliver(self, response: service_pb2.ModelStreamInferResponse) -> None:
        correlation = response.infer_response.id
        future = self.pending.pop(correlation, None)
        if future is not None:
            self._sent_at.pop(correlation, None)
            if not future.done():
                if response.error_message:
                    future.set_exception(triton_errors.from_stream_error(response.error_message))
                else:
                    future.set_result(response.infer_response)
        elif (responses := self.streams.get(correlation)) is not None:
            if responses.push(response):
                del self.streams[correlation]
        else:
            # A response for a request already timed out (or unknown): never used twice.
            log.debug("late_response_dropped", correlation=correlation, stream=self.index)
        if not self.pending and not self.streams:
            self._idle.set()

    def _fail_pending(self, error: errors.WorkerError) -> None:
        pending, self.pending = self.pending, {}
        streams, self.streams = self.streams, {}
        self._sent_at.clear()
        for future in pending.values():
            if not future.done():
                future.set_exception(error)
        for responses in streams.values():
            responses.fail(error)
        self._idle.set()

    def submit(
        self, request: service_pb2.ModelInferRequest
    ) -> asyncio.Future[service_pb2.ModelInferResponse]:
        future: asyncio.Future[service_pb2.ModelInferResponse] = (
            asyncio.get_running_loop().create_future()
        )
        self.pending[request.id] = future
        self._sent_at[request.id] = time.monotonic()
        self._idle.clear()
        self._outbox.put_nowait(request)
        return future

    def submit_stream(self, request: service_pb2.ModelInferRequest) -> ResponseStream:
        """Send a decoupled model's request; its responses arrive on the returned queue."""
        responses = ResponseStream(request.id, self.forget)
        self.streams[request.id] = responses
        self._idle.clear()
        self._outbox.put_nowait(request)
        return responses

    def forget(self, correlation: str) -> None:
        self.pending.pop(correlation, None)
        self._sent_at.pop(correlation, None)
        self.streams.pop(correlation, None)
        if not self.pending and not self.streams:
            self._idle.set()

    async def close(self, drain_timeout_s: float) -> None:
        """Wait (bounded) for every owed response, then abandon the call.

        Cancelling rather than half-closing: tritonserver 2.51 was seen to crash
        when a client half-closed a stream, even an idle one, while cancelling
        never crashed it.
        """
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        self._abandoned = True
        if self._call is not None:
            self._call.cancel()
        self._outbox.put_nowait(None)
