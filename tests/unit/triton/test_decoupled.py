"""One decoupled request's responses on a stream: queued in order until the final one.

The responses are protobuf messages built here, as Triton sends them: a unit test
cannot make a real server interleave, fail or stall streams at chosen points. The
integration tests run the same paths against a real Triton.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from tritonclient.grpc import service_pb2

from worker import errors
from worker.triton.decoupled import ResponseStream, is_final
from worker.triton.stream import Stream

pytestmark = pytest.mark.timeout(10)


def _response(correlation: str, final: bool = False, error: str = "") -> Any:
    message = service_pb2.ModelStreamInferResponse(error_message=error)
    message.infer_response.id = correlation
    message.infer_response.parameters["triton_final_response"].bool_param = final
    if not final:
        message.infer_response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    return message


def _stream() -> tuple[ResponseStream, list[str]]:
    released: list[str] = []
    return ResponseStream("7", released.append), released


async def test_responses_come_out_in_order_then_the_end() -> None:
    """Two responses and a final one: read in arrival order, then None, again None."""
    responses, _ = _stream()
    assert responses.push(_response("7")) is False
    assert responses.push(_response("7")) is False
    assert responses.push(_response("7", final=True)) is True
    deadline = time.monotonic() + 1
    first = await responses.next(deadline)
    assert first is not None and not is_final(first)
    second = await responses.next(deadline)
    assert second is not None and not is_final(second)
    final = await responses.next(deadline)
    assert final is not None and is_final(final)
    assert await responses.next(deadline) is None
    assert await responses.next(deadline) is None
    assert responses.arrived == 3


async def test_an_error_response_ends_the_request_with_its_error() -> None:
    """An error response after one token: the token, then the mapped error, every time."""
    responses, _ = _stream()
    responses.push(_response("7"))
    assert responses.push(_response("7", final=True, error="tokens: failure requested")) is True
    assert await responses.next(time.monotonic() + 1) is not None
    for _ in range(2):
        with pytest.raises(errors.InferenceError, match="failure requested"):
            await responses.next(time.monotonic() + 1)


async def test_nothing_by_the_deadline_is_a_timeout_saying_what_was_late() -> None:
    """An empty queue past its deadline: TritonTimeout with the caller's words."""
    responses, _ = _stream()
    with pytest.raises(errors.TritonTimeout, match="no next response"):
        await responses.next(time.monotonic() + 0.01, "no next response")
    with pytest.raises(errors.TritonTimeout):
        await responses.next(time.monotonic() - 1)


async def test_a_queued_response_is_returned_whatever_the_deadline() -> None:
    """A response that arrived in time is not lost because it is read late."""
    responses, _ = _stream()
    responses.push(_response("7"))
    assert await responses.next(time.monotonic() - 5) is not None


async def test_a_waiting_reader_wakes_on_the_next_response() -> None:
    """The owner waits; the stream's reader pushes: the owner gets it, with its arrival."""
    responses, _ = _stream()
    reader = asyncio.create_task(responses.next(time.monotonic() + 5))
    await asyncio.sleep(0)  # one turn of the loop: the reader is waiting on the queue
    responses.push(_response("7"))
    assert await reader is not None
    assert responses.last_arrival >= responses.sent_at


class _Stub:
    """The gRPC stub's ModelStreamInfer: a call that yields the responses it is given."""

    def __init__(self) -> None:
        self.responses: asyncio.Queue[Any] = asyncio.Queue()

    def ModelStreamInfer(self, requests: Any, metadata: Any = None) -> Any:
        stub = self

        class Call:
            def __aiter__(self) -> Any:
                return self

            async def __anext__(self) -> Any:
                item = await stub.responses.get()
                if item is None:
                    raise StopAsyncIteration
                return item

            def cancel(self) -> None:
                stub.responses.put_nowait(None)

        return Call()


async def test_a_stream_routes_responses_by_id_beside_single_requests() -> None:
    """One decoupled and one ordinary request on a stream: each gets its own responses."""
    stub = _Stub()
    stream = Stream(stub, 0, {})
    running = asyncio.create_task(stream.run())
    decoupled = stream.submit_stream(service_pb2.ModelInferRequest(id="d"))
    single = stream.submit(service_pb2.ModelInferRequest(id="s"))
    assert stream.load() == 2
    for message in (_response("d"), _response("s", final=True), _response("d", final=True)):
        stub.responses.put_nowait(message)
    assert (await single).id == "s"
    deadline = time.monotonic() + 1
    assert (await decoupled.next(deadline)) is not None
    assert is_final(await decoupled.next(deadline))
    assert stream.load() == 0
    # The stream breaking fails a decoupled request still owed responses.
    pending = stream.submit_stream(service_pb2.ModelInferRequest(id="p"))
    stub.responses.put_nowait(None)
    await running
    with pytest.raises(errors.TritonUnavailable):
        await pending.next(time.monotonic() + 1)


async def test_closing_a_request_releases_its_place_on_the_stream() -> None:
    """The owner gives up (a timeout): the stream forgets it, later responses are dropped."""
    stream = Stream(_Stub(), 0, {})
    responses = stream.submit_stream(service_pb2.ModelInferRequest(id="d"))
    assert stream.load() == 1
    responses.close()
    assert stream.load() == 0
    stream._deliver(_response("d"))  # late: dropped, not an error
    assert not responses.queued()


async def test_decoupled_requests_get_streams_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first decoupled request opens a second group of streams; ordinary ones stay put."""
    from worker.triton import server as pool_module

    stub = _Stub()
    monkeypatch.setattr(pool_module, "grpc_stub", lambda client: stub)
    pool = pool_module.ServerPool("127.0.0.1:1", 2)
    await pool.start()
    try:
        ordinary = service_pb2.ModelInferRequest(model_name="double")
        assert pool._pick(ordinary).index in (0, 1) and len(pool._streams) == 2
        responses = pool.infer_stream(service_pb2.ModelInferRequest(model_name="tokens"))
        assert len(pool._streams) == 4
        owner = next(s for s in pool._streams if responses.correlation in s.streams)
        assert owner.index in (2, 3)
        assert pool.in_flight() == 1
        assert pool._pick(ordinary).index in (0, 1)
        responses.close()
        assert pool.in_flight() == 0
    finally:
        await pool.close(drain_timeout_s=0.1)
