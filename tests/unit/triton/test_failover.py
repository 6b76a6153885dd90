"""A decoupled request whose endpoint is lost: sent elsewhere, or a failover, never an outage.

The per-endpoint pools are fakes at the ``ServerPool`` seam handing out real
``ResponseStream`` objects, which the test answers or breaks as a stream would: a unit
test cannot make a real server die between two chosen responses (the fault tests kill
a real one mid-stream).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from tritonclient.grpc import service_pb2

from tests.unit.triton.test_endpoints import FakeServer
from worker import errors
from worker.observability.metrics import Metrics
from worker.triton import pool as pool_module
from worker.triton.decoupled import ResponseStream, is_final

pytestmark = pytest.mark.timeout(10)

A, B = "10.0.0.1:1", "10.0.0.2:1"


class StreamingServer(FakeServer):
    """A ServerPool stand-in whose decoupled requests the test answers or breaks."""

    def __init__(self, address: str, streams: int, **kwargs: Any) -> None:
        super().__init__(address, streams, **kwargs)
        self.requests: list[service_pb2.ModelInferRequest] = []
        self.streams: list[ResponseStream] = []
        self.refuse = False
        #: Responses sent at once to the next request (True: the final one).
        self.script: list[bool] = []

    def infer_stream(self, request: service_pb2.ModelInferRequest) -> ResponseStream:
        if self.refuse:
            raise errors.TritonUnavailable("the inference stream broke: connection refused")
        self.requests.append(request)
        self.streams.append(ResponseStream(str(len(self.streams)), lambda _: None))
        for final in self.script:
            self.answer(final=final)
        return self.streams[-1]

    def answer(self, final: bool = False, error: str = "") -> None:
        message = service_pb2.ModelStreamInferResponse(error_message=error)
        message.infer_response.parameters["triton_final_response"].bool_param = final
        self.streams[-1].push(message)

    def lose(self) -> None:
        """The stream carrying the request broke (the server died)."""
        self.streams[-1].fail(errors.TritonUnavailable("the inference stream broke"))


async def _pool(metrics: Metrics, monkeypatch: pytest.MonkeyPatch) -> pool_module.TritonPool:
    monkeypatch.setattr(pool_module, "ServerPool", StreamingServer)
    pool = pool_module.TritonPool(f"{A},{B}", 1, metrics=metrics)
    await pool.start()
    return pool


def _servers(pool: pool_module.TritonPool) -> dict[str, StreamingServer]:
    return {e.address: e.pool for e in pool.endpoints}


def _request() -> service_pb2.ModelInferRequest:
    return service_pb2.ModelInferRequest(model_name="tokens", id="r")


def _count(metrics: Metrics, address: str, outcome: str) -> float:
    value: float = metrics.triton_endpoint_requests_total.labels(address, outcome)._value.get()
    return value


SOON = 5.0


async def test_lost_before_any_response_it_is_answered_by_another_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first endpoint dies before answering: the reader gets the other one's responses."""
    metrics = Metrics()
    pool = await _pool(metrics, monkeypatch)
    responses = pool.infer_stream(_request())
    first = next(e for e in pool.endpoints if e.pool.streams)
    other = next(e for e in pool.endpoints if e is not first)
    other.pool.script = [False, True]  # a token, then the final
    first.pool.lose()
    deadline = time.monotonic() + SOON
    token, final = await responses.next(deadline), await responses.next(deadline)
    responses.close()
    assert token is not None and not is_final(token)
    assert final is not None and is_final(final)
    (sent_again,) = other.pool.requests
    assert sent_again.model_name == "tokens" and sent_again is not first.pool.requests[0]
    assert not first.up and other.up
    assert _count(metrics, first.address, "unavailable") == 1
    assert _count(metrics, other.address, "ok") == 1
    await pool.close()


async def test_lost_after_a_response_it_is_a_failover_not_an_outage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A response read, then the endpoint dies: TritonFailover (retryable), endpoint down."""
    metrics = Metrics()
    pool = await _pool(metrics, monkeypatch)
    responses = pool.infer_stream(_request())
    serving = next(s for s in _servers(pool).values() if s.streams)
    serving.answer()
    deadline = time.monotonic() + SOON
    assert await responses.next(deadline) is not None
    serving.lose()
    with pytest.raises(errors.TritonFailover, match="1 response"):
        await responses.next(deadline)
    responses.close()
    assert [e.up for e in pool.endpoints if e.pool is serving] == [False]
    await pool.close()


async def test_lost_with_no_other_endpoint_up_it_is_the_outage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other endpoint is down already: the loss is an outage (plain TritonUnavailable)."""
    pool = await _pool(Metrics(), monkeypatch)
    servers = _servers(pool)
    next(e for e in pool.endpoints if e.address == B).mark_down("test")
    responses = pool.infer_stream(_request())
    assert servers[A].streams and not servers[B].streams
    servers[A].lose()
    with pytest.raises(errors.TritonUnavailable) as caught:
        await responses.next(time.monotonic() + SOON)
    assert not isinstance(caught.value, errors.TritonFailover)
    assert servers[B].requests == []
    await pool.close()


async def test_an_error_response_is_the_answer_and_the_endpoint_stays_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Triton answers with an error: that error, no failover, the endpoint in rotation."""
    metrics = Metrics()
    pool = await _pool(metrics, monkeypatch)
    responses = pool.infer_stream(_request())
    serving = next(e for e in pool.endpoints if e.pool.streams)
    serving.pool.answer(final=True, error="tokens: failure requested")
    with pytest.raises(errors.InferenceError):
        await responses.next(time.monotonic() + SOON)
    responses.close()
    assert all(e.up for e in pool.endpoints)
    assert _count(metrics, serving.address, "error") == 1
    await pool.close()


async def test_a_refused_submission_goes_to_the_other_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An endpoint whose streams are all broken refuses at once: the other one takes it."""
    pool = await _pool(Metrics(), monkeypatch)
    servers = _servers(pool)
    servers[A].refuse = True
    for _ in range(2):  # whichever the first choice, both land on B
        pool.infer_stream(_request()).close()
    assert len(servers[B].streams) == 2 and servers[A].streams == []
    await pool.close()
