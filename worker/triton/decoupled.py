"""The responses of one decoupled request on a stream, queued as they arrive, until the final.

A decoupled model answers a request with any number of responses, all carrying
the request's id. The worker asks Triton for an empty final response
(``triton_enable_empty_final_response``), so the last response of every request
carries ``triton_final_response: true`` and the worker knows when it is complete.
The stream's reader pushes responses here; the request's owner reads them with
deadlines of its own (first response, gap between responses, the whole record).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Final, TypeAlias

from tritonclient.grpc import service_pb2

from worker import errors
from worker.triton import errors as triton_errors

__all__ = ["ENABLE_EMPTY_FINAL", "ResponseStream", "is_final"]

#: Request parameter asking Triton to mark (or send) a final response.
ENABLE_EMPTY_FINAL: Final = "triton_enable_empty_final_response"
#: Response parameter on the last response of a request.
_FINAL: Final = "triton_final_response"

#: What the queue holds: a response, the error that ended the request, or its end.
_Item: TypeAlias = service_pb2.ModelInferResponse | errors.WorkerError | None


def is_final(response: service_pb2.ModelInferResponse) -> bool:
    """True when ``response`` is the last of its request (``triton_final_response``)."""
    params = response.parameters
    return _FINAL in params and params[_FINAL].bool_param


class ResponseStream:
    """One decoupled request's responses, in arrival order, each with its arrival time."""

    def __init__(self, correlation: str, release: Callable[[str], None]) -> None:
        self.correlation = correlation
        self._release = release
        self._queue: asyncio.Queue[tuple[float, _Item]] = asyncio.Queue()
        #: When the request was sent, then when the response last read had arrived.
        self.sent_at = self.last_arrival = time.monotonic()
        #: Responses that arrived (the empty final one included).
        self.arrived = 0
        self.ended = False
        #: True when the stream carrying it broke before its final response.
        self.lost = False

    # -- the stream's reader ------------------------------------------------------

    def push(self, response: service_pb2.ModelStreamInferResponse) -> bool:
        """Queue one response; True when it ends the request (final flag, or an error)."""
        now = time.monotonic()
        self.arrived += 1
        if response.error_message:
            self._end(now, triton_errors.from_stream_error(response.error_message))
            return True
        infer = response.infer_response
        self._queue.put_nowait((now, infer))
        if is_final(infer):
            self._end(now, None)
            return True
        return False

    def fail(self, error: errors.WorkerError) -> None:
        """The stream broke before the final response: the request ends with ``error``."""
        if not self.ended:
            self.lost = True
            self._end(time.monotonic(), error)

    def _end(self, now: float, item: errors.WorkerError | None) -> None:
        self.ended = True
        self._queue.put_nowait((now, item))

    # -- the request's owner --------------------------------------------------------

    def queued(self) -> bool:
        """True when a response (or the request's end) has arrived and not been read yet."""
        return not self._queue.empty()

    async def next(
        self, deadline: float, late: str = "no response from Triton in time"
    ) -> service_pb2.ModelInferResponse | None:
        """The next response, or None once the final one was read.

        Raises the error that ended the request (an error response, a broken
        stream), or TritonTimeout saying ``late`` when nothing arrived by
        ``deadline`` (``time.monotonic()``); a response already queued is
        returned whatever the deadline.
        """
        if self._queue.empty():
            wait_s = deadline - time.monotonic()
            if wait_s <= 0:
                raise errors.TritonTimeout(late)
            try:
                async with asyncio.timeout(wait_s):
                    arrived, item = await self._queue.get()
            except TimeoutError:
                raise errors.TritonTimeout(late) from None
        else:
            arrived, item = self._queue.get_nowait()
        self.last_arrival = arrived
        if isinstance(item, errors.WorkerError):
            self._queue.put_nowait((arrived, item))  # the end stays the end
            raise item
        if item is None:
            self._queue.put_nowait((arrived, None))
        return item

    def close(self) -> None:
        """The owner is done with the request: responses still to come are dropped."""
        self._release(self.correlation)
