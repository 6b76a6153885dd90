"""A decoupled model's request through StreamCalls: collected, or relayed as it arrives.

The pool is a fake that streams scripted responses into a real ResponseStream, and
the sink a fake that records what it is given (and can hold an ack back): a unit
test cannot make a real Triton fail or stall a stream at a chosen response, nor a
real broker hold one ack. The integration tests run the same paths for real.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord
from tritonclient.grpc import service_pb2

from devtools.samples import token_request
from tests.unit.records.fakes import steps_for
from worker import errors, wire
from worker.flow.breaker import CircuitBreaker
from worker.flow.retry import Budget
from worker.observability import Metrics
from worker.records.stream import StreamCalls, StreamRules
from worker.settings import load_settings
from worker.triton.decoupled import ResponseStream
from worker.wire.bytes_tensor import serialize_bytes_tensor

pytestmark = pytest.mark.timeout(10)

#: A script step: a token, the final flag alone (None), or an error text.
Step = str | None | errors.WorkerError


def _token(text: str, final: bool) -> Any:
    message = service_pb2.ModelStreamInferResponse()
    response = message.infer_response
    response.model_name, response.model_version = "tokens", "1"
    response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    response.raw_output_contents.append(serialize_bytes_tensor([text.encode()]))
    response.parameters["triton_final_response"].bool_param = final
    return message


def _final_alone() -> Any:
    message = service_pb2.ModelStreamInferResponse()
    message.infer_response.parameters["triton_final_response"].bool_param = True
    return message


class FakePool:
    """Streams each try's script into a ResponseStream, one step per loop turn (or on cue)."""

    def __init__(self, *scripts: Sequence[Step], cue: asyncio.Event | None = None) -> None:
        self.scripts = list(scripts)
        self.cue = cue  # set: the steps after the first wait for it
        self.tries = 0
        self.closed: list[str] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def infer_stream(self, request: Any) -> ResponseStream:
        self.tries += 1
        script = self.scripts.pop(0)
        responses = ResponseStream(str(self.tries), self.closed.append)
        task = asyncio.create_task(self._play(responses, script))
        self._tasks.add(task)
        return responses

    async def _play(self, responses: ResponseStream, script: Sequence[Step]) -> None:
        for index, step in enumerate(script):
            await asyncio.sleep(0)
            if index == 1 and self.cue is not None:
                await self.cue.wait()
            last = index == len(script) - 1
            if isinstance(step, errors.WorkerError):
                responses.fail(step)
            elif step is None:
                responses.push(_final_alone())
            else:
                responses.push(_token(step, final=last))


class FakeSink:
    """Records each publish_results call; the first one waits for ``release`` if given."""

    def __init__(self, release: asyncio.Event | None = None) -> None:
        self.calls: list[list[tuple[bytes, Any]]] = []
        self.release = release
        self.holding = asyncio.Event()

    async def publish_result(self, record: Any, value: bytes, headers: Any) -> None:
        raise AssertionError("streams publish through publish_results")

    async def publish_results(self, record: Any, results: Sequence[tuple[bytes, Any]]) -> None:
        if self.release is not None and not self.calls:
            self.holding.set()
            self.calls.append(list(results))
            await self.release.wait()
            return
        self.calls.append(list(results))

    async def publish_dead_letter(self, record: Any, headers: Any) -> None:
        raise AssertionError("dead letters are the per-record path's")


def _calls(pool: FakePool, **env: str) -> tuple[StreamCalls, Metrics]:
    settings = load_settings(
        {
            "WORKER_INPUT_TOPICS": "in",
            "WORKER_OUTPUT_TOPIC": "out",
            "WORKER_DLQ_TOPIC": "dlq",
            "WORKER_MAX_ATTEMPTS": "3",
            "WORKER_RETRY_BACKOFF_MS": "1",
            "WORKER_RETRY_BACKOFF_MAX_MS": "2",
            **{f"WORKER_{k.upper()}": v for k, v in env.items()},
        }
    )
    metrics = Metrics(version="test")
    steps = steps_for(settings, metrics=metrics, breaker=CircuitBreaker(100))
    calls = StreamCalls(StreamRules.from_settings(settings), pool, steps)  # type: ignore[arg-type]
    return calls, metrics


def _request() -> wire.DecodedRequest:
    sample = token_request("r1", "a b c", 3)
    return wire.decode_request(
        sample.value, sample.headers, wire.Source("in", 0, 7), wire.DecodeLimits(1 << 20), None
    )


def _record() -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord("in", 0, 7, 0, 0, b"r1", b"", None, 2, 0, [])


def _texts(results: Sequence[tuple[bytes, Any]]) -> list[list[str]]:
    return [
        [item for output in json.loads(value)["outputs"] for item in output["data"]]
        for value, _ in results
    ]


async def _evaluate(calls: StreamCalls) -> Any:
    return await calls.evaluate(_request(), Budget.lasting(10), _record(), wire.Source("in", 0, 7))


async def test_final_mode_joins_the_tokens_and_counts_them() -> None:
    """Three tokens, the final flag on the last: one result, BYTES [3], x-response-count 3."""
    pool = FakePool(["a", " b", " c"])
    calls, metrics = _calls(pool)
    streamed = await _evaluate(calls)
    [(value, headers)] = streamed.results
    assert _texts(streamed.results) == [["a", " b", " c"]]
    assert dict(headers)["x-response-count"] == b"3"
    assert json.loads(value)["outputs"][0]["shape"] == [3]
    assert pool.closed == ["1"]  # the stream's place was released
    count = metrics.registry.get_sample_value("worker_stream_responses_sum", {"model": "tokens"})
    assert count == 3


async def test_final_mode_retries_the_whole_request_after_a_broken_stream() -> None:
    """The first try breaks after a token: its partial response is discarded, not joined."""
    broken = errors.TritonUnavailable("the inference stream broke")
    pool = FakePool(["x", broken], ["a", " b"])
    calls, _ = _calls(pool)
    streamed = await _evaluate(calls)
    assert _texts(streamed.results) == [["a", " b"]]
    assert (pool.tries, streamed.attempts) == (2, 2)


async def test_final_mode_bounds_what_it_collects() -> None:
    """Responses past WORKER_MAX_OUTPUT_BYTES: OUTPUT_TOO_LARGE, with how many had come."""
    pool = FakePool(["a" * 40, "b" * 40, "c"])
    calls, _ = _calls(pool, max_output_bytes="64")
    with pytest.raises(errors.OutputTooLarge) as caught:
        await _evaluate(calls)
    assert dict(caught.value.facts)["x-responses-received"] == b"2"


async def test_each_mode_relays_what_arrived_while_an_ack_was_awaited() -> None:
    """The first result's ack is held; three more tokens arrive: they go out as one batch."""
    release, cue = asyncio.Event(), asyncio.Event()
    pool = FakePool(["a", " b", " c", None], cue=cue)
    sink = FakeSink(release)
    calls, metrics = _calls(pool, stream_output="each")
    streamed = await _evaluate(calls)
    publishing = asyncio.create_task(calls.publish(streamed, _record(), sink))
    await sink.holding.wait()
    cue.set()
    await asyncio.gather(*pool._tasks)  # every step pushed while the ack is held
    release.set()
    await publishing
    assert [len(call) for call in sink.calls] == [1, 3]
    results = [result for call in sink.calls for result in call]
    assert _texts(results) == [["a"], [" b"], [" c"], []]
    headers = [dict(h) for _, h in results]
    assert [h["x-response-index"] for h in headers] == [b"0", b"1", b"2", b"3"]
    assert [h["x-response-final"] for h in headers] == [b"false"] * 3 + [b"true"]
    assert headers[-1]["x-response-count"] == b"4"
    assert streamed.published == 4
    published = metrics.registry.get_sample_value(
        "worker_results_published_total", {"model": "tokens"}
    )
    assert published == 4  # counted by the steps as they went out


async def test_each_mode_stops_after_a_failure_saying_what_was_published() -> None:
    """Two tokens, then an error: both published, then the error with the stream's facts."""
    pool = FakePool(["a", " b", errors.InferenceError("Triton: tokens: failure requested")])
    sink = FakeSink()
    calls, _ = _calls(pool, stream_output="each")
    streamed = await _evaluate(calls)
    with pytest.raises(errors.InferenceError) as caught:
        await calls.publish(streamed, _record(), sink)
    assert _texts([r for call in sink.calls for r in call]) == [["a"], [" b"]]
    facts = dict(caught.value.facts)
    assert (facts["x-responses-published"], facts["x-responses-received"]) == (b"2", b"2")
    assert "not retried: 2 result(s)" in caught.value.message
    assert pool.tries == 1


async def test_each_mode_checks_every_response_on_its_own() -> None:
    """One token too large to publish: those before it go out, then OUTPUT_TOO_LARGE."""
    pool = FakePool(["a", "b" * 400, "c"])
    sink = FakeSink()
    calls, _ = _calls(pool, stream_output="each", max_output_bytes="300")
    streamed = await _evaluate(calls)
    with pytest.raises(errors.OutputTooLarge) as caught:
        await calls.publish(streamed, _record(), sink)
    assert _texts([r for call in sink.calls for r in call]) == [["a"]]
    assert dict(caught.value.facts)["x-responses-published"] == b"1"


async def test_each_mode_under_exactly_once_hands_over_the_whole_stream_at_once() -> None:
    """exactly_once: collected first (a retry stays safe), then one publish_results call."""
    broken = errors.TritonUnavailable("the inference stream broke")
    pool = FakePool(["x", broken], ["a", " b"])
    sink = FakeSink()
    calls, _ = _calls(pool, stream_output="each", delivery="exactly_once")
    streamed = await _evaluate(calls)
    assert streamed.live is None
    await calls.publish(streamed, _record(), sink)
    [call] = sink.calls
    assert _texts(call) == [["a"], [" b"]]
    assert [dict(h)["x-response-final"] for _, h in call] == [b"false", b"true"]


async def test_no_first_response_in_time_is_retried_then_given_up() -> None:
    """A stream that never answers: TritonTimeout naming WORKER_REQUEST_TIMEOUT_MS, 3 tries."""
    pool = FakePool([], [], [])
    calls, _ = _calls(pool, request_timeout_ms="20")
    with pytest.raises(errors.RetriesExhausted, match="WORKER_REQUEST_TIMEOUT_MS") as caught:
        await _evaluate(calls)
    assert pool.tries == 3
    assert dict(caught.value.facts)["x-responses-received"] == b"0"
