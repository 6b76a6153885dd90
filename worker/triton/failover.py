"""A decoupled request whose endpoint is lost: sent to another endpoint, not counted as an outage.

A decoupled request is answered over time on one stream of one endpoint. When that
stream breaks (the server died, the connection dropped), the request is lost with
it, and only the endpoint is down, not Triton, while another endpoint is up:

- lost before any response was read, it is sent again at once to another up
  endpoint, and its reader sees nothing but a later first response;
- lost after responses were read, those cannot be taken back: the reader gets
  ``TritonFailover`` (retryable, and not an outage: the record's retrier sends it
  again at once, elsewhere, without counting it against the worker-wide breaker),
  or, when no other endpoint is up, the outage itself.

An error *response* is Triton's answer, not a lost endpoint: it ends the request as is.
"""

from __future__ import annotations

from typing import Any, Protocol

from tritonclient.grpc import service_pb2

from worker import errors
from worker.triton.decoupled import ResponseStream, is_final
from worker.triton.endpoints import Endpoint

__all__ = ["FailoverStream", "StreamEndpoints"]


class StreamEndpoints(Protocol):
    """The endpoints a decoupled request may go to (the pool's side)."""

    def submit_stream(
        self, request: service_pb2.ModelInferRequest, avoid: list[str]
    ) -> tuple[ResponseStream, Endpoint[Any]]:
        """Send ``request`` to an up endpoint not in ``avoid`` (its address is added there):
        its responses and that endpoint. Raises TritonUnavailable when none can take it."""
        ...

    def stream_ended(
        self,
        endpoint: Endpoint[Any],
        model: tuple[str, str],
        outcome: str,
        error: errors.WorkerError | None,
    ) -> bool:
        """A request ended on ``endpoint``: ``ok``, ``error``, or ``unavailable`` (lost: the
        endpoint is marked down). True when another endpoint is up for ``model``."""
        ...


class FailoverStream:
    """A decoupled request's responses, read like a ResponseStream, across endpoints."""

    def __init__(self, endpoints: StreamEndpoints, request: service_pb2.ModelInferRequest) -> None:
        """Send the request (raises TritonUnavailable when no endpoint can take it)."""
        self._endpoints, self._request = endpoints, request
        self._model = (request.model_name, request.model_version)
        self._tried: list[str] = []
        self._current, self._endpoint = endpoints.submit_stream(request, self._tried)
        #: When the request was first sent (a failover does not restart its deadlines).
        self.sent_at = self._current.sent_at
        self._read = 0
        self._done = False

    @property
    def last_arrival(self) -> float:
        """When the response last read arrived (when the request was sent, before any)."""
        return self._current.last_arrival

    def queued(self) -> bool:
        """True when a response (or the request's end) has arrived and not been read yet."""
        return self._current.queued()

    async def next(
        self, deadline: float, late: str = "no response from Triton in time"
    ) -> service_pb2.ModelInferResponse | None:
        """The next response, or None after the final one (see ``ResponseStream.next``)."""
        while True:
            try:
                response = await self._current.next(deadline, late)
            except errors.WorkerError as error:
                if not self._current.lost:
                    self._end("error", error)
                    raise
                self._fail_over(error)
                continue
            if response is None or is_final(response):
                self._end("ok", None)
            if response is not None:
                self._read += 1
            return response

    def _fail_over(self, error: errors.WorkerError) -> None:
        """The endpoint was lost: send the request again, or raise what the reader sees."""
        self._done = True
        another_up = self._endpoints.stream_ended(self._endpoint, self._model, "unavailable", error)
        if self._read or not another_up:
            if another_up:
                raise errors.TritonFailover(
                    f"{error.message}; {self._read} response(s) had arrived: sent again to "
                    "another Triton endpoint"
                )
            raise error
        self._current.close()
        # A copy: the broken stream may still hold the message it was given.
        request = service_pb2.ModelInferRequest()
        request.CopyFrom(self._request)
        try:
            self._current, self._endpoint = self._endpoints.submit_stream(request, self._tried)
        except errors.TritonUnavailable:
            raise error from None
        self._done = False

    def _end(self, outcome: str, error: errors.WorkerError | None) -> None:
        if not self._done:
            self._done = True
            self._endpoints.stream_ended(self._endpoint, self._model, outcome, error)

    def close(self) -> None:
        """The reader is done with the request: responses still to come are dropped."""
        self._end("error", None)  # left before its final response (a deadline, a failure)
        self._current.close()
