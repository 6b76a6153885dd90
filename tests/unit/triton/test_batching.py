"""Micro-batching: which requests may join, merging and splitting, failure isolation.

Most behaviour is tested against a real Triton in tests/integration/test_batching.py.
The fake pool here exists only to inject failures a real Triton cannot be made
to produce on demand for one batch: a retryable error (overload) on exactly the
batched request, and a permanent error on any batch holding a marked request.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from devtools.samples import Tensor
from tests.support import decode_sample
from worker import errors, wire
from worker.observability.inflight import InFlight
from worker.triton.batching import MicroBatcher, batchable
from worker.triton.merging import merge as _merge
from worker.triton.merging import split as _split
from worker.wire.tensors import deserialize_bytes_tensor, serialize_bytes_tensor
from worker.wire.validation import ModelSpec, TensorSpec

pytestmark = pytest.mark.timeout(10)

SPEC = ModelSpec(
    name="m",
    version="1",
    inputs=(TensorSpec("INPUT0", "FP32", (-1,)),),
    outputs=(TensorSpec("OUTPUT0", "FP32", (-1,)),),
    max_batch_size=64,
)
TEXT_SPEC = ModelSpec(
    name="t",
    version="1",
    inputs=(TensorSpec("TEXT", "BYTES", (-1,)),),
    outputs=(TensorSpec("TEXT", "BYTES", (-1,)),),
    max_batch_size=64,
)


def decoded(tensors: list[Tensor], model: str = "m", rid: str = "r") -> wire.DecodedRequest:
    return decode_sample(model, tensors, rid)


def floats(rows: int, width: int = 4, start: float = 0.0) -> wire.DecodedRequest:
    values = (np.arange(rows * width, dtype=np.float32) + start).reshape(rows, width)
    return decoded([Tensor("INPUT0", "FP32", (rows, width), values)], rid=f"f{start}")


def texts(words: list[str]) -> wire.DecodedRequest:
    return decoded([Tensor("TEXT", "BYTES", (len(words), 1), words)], model="t")


class EchoPool:
    """Answers each request with its inputs as outputs; fails batches as told."""

    def __init__(self, *, poison: bytes | None = None, retryable: bool = False) -> None:
        self.poison = poison
        self.retryable = retryable
        self.sent: list[int] = []

    async def infer(self, request: Any, timeout_s: float) -> Any:
        rows = int(request.inputs[0].shape[0])
        self.sent.append(rows)
        if self.retryable and rows > 1:
            raise errors.TritonOverloaded("queue full")
        if self.poison is not None and any(
            self.poison in raw for raw in request.raw_input_contents
        ):
            raise errors.InferenceError("model failed on this request")
        response = service_pb2.ModelInferResponse(model_name=request.model_name, model_version="1")
        for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=True):
            response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            response.raw_output_contents.append(raw)
        return response


def test_batchable_needs_a_batching_model_and_one_batch_dimension() -> None:
    """Only raw inputs with one shared batch dimension, for a batching model, may join."""
    assert batchable(SPEC, floats(2))
    unbatched = ModelSpec("m", "1", SPEC.inputs, SPEC.outputs, max_batch_size=0)
    assert not batchable(unbatched, floats(2))
    sequence = floats(1)
    sequence.infer_request.parameters["sequence_id"].int64_param = 7
    assert not batchable(SPEC, sequence)
    two = decoded(
        [
            Tensor("INPUT0", "FP32", (2, 1), np.zeros((2, 1), np.float32)),
            Tensor("INPUT1", "FP32", (3, 1), np.zeros((3, 1), np.float32)),
        ]
    )
    assert not batchable(SPEC, two)


def test_merge_then_split_gives_each_request_its_rows() -> None:
    """Merged FP32 rows come back to their owners in order, shaped as sent."""
    requests = [floats(1, start=0), floats(3, start=100), floats(2, start=200)]
    merged = _merge([r.infer_request for r in requests])
    assert list(merged.inputs[0].shape) == [6, 4]
    response = service_pb2.ModelInferResponse(model_name="m", model_version="1")
    response.outputs.add(name="OUTPUT0", datatype="FP32", shape=[6, 4])
    response.raw_output_contents.append(merged.raw_input_contents[0])
    parts = _split(response, [1, 3, 2], 6)
    for request, part in zip(requests, parts, strict=True):
        assert list(part.outputs[0].shape) == list(request.infer_request.inputs[0].shape)
        assert part.raw_output_contents[0] == request.infer_request.raw_input_contents[0]
        assert part.model_version == "1"


def test_split_of_bytes_follows_the_length_prefixes() -> None:
    """BYTES elements of varying length are split per request, not per byte count."""
    requests = [texts(["a"]), texts(["héllo wörld", ""]), texts(["日本語", "b", "cc"])]
    merged = _merge([r.infer_request for r in requests])
    response = service_pb2.ModelInferResponse(model_name="t", model_version="1")
    response.outputs.add(name="TEXT", datatype="BYTES", shape=[6, 1])
    response.raw_output_contents.append(merged.raw_input_contents[0])
    parts = _split(response, [1, 2, 3], 6)
    got = [deserialize_bytes_tensor(p.raw_output_contents[0]) for p in parts]
    assert got == [[b"a"], ["héllo wörld".encode(), b""], ["日本語".encode(), b"b", b"cc"]]


async def test_a_poison_pill_fails_alone_and_its_neighbours_succeed() -> None:
    """A permanent failure of a batch is bisected down to the one bad request."""
    pool = EchoPool(poison=serialize_bytes_tensor([b"POISON"]))
    batcher = MicroBatcher(pool, max_batch_size=8, delay_s=1.0)  # type: ignore[arg-type]
    words = [f"w{i}" for i in range(8)]
    words[5] = "POISON"
    calls = [batcher.infer(texts([w]), TEXT_SPEC, 5.0) for w in words]
    results = await asyncio.gather(*calls, return_exceptions=True)
    for word, result in zip(words, results, strict=True):
        if word == "POISON":
            assert isinstance(result, errors.InferenceError)
        else:
            assert not isinstance(result, BaseException)
            assert deserialize_bytes_tensor(result.raw_output_contents[0]) == [word.encode()]
    assert pool.sent[0] == 8
    assert batcher.stats.bisections >= 3
    await batcher.close()


async def test_a_retryable_batch_failure_fails_every_request_as_retryable() -> None:
    """Overload of the batched request is not bisected: all callers get a retryable error."""
    pool = EchoPool(retryable=True)
    batcher = MicroBatcher(pool, max_batch_size=4, delay_s=1.0)  # type: ignore[arg-type]
    results = await asyncio.gather(
        *(batcher.infer(floats(1, start=i), SPEC, 5.0) for i in range(4)), return_exceptions=True
    )
    assert all(isinstance(r, errors.TritonOverloaded) for r in results)
    assert pool.sent == [4]
    await batcher.close()


async def test_close_fails_requests_still_waiting_for_company() -> None:
    """A request waiting for its batch to fill gets a retryable error at close."""
    pool = EchoPool()
    batcher = MicroBatcher(pool, max_batch_size=8, delay_s=60.0)  # type: ignore[arg-type]
    entered = asyncio.Event()

    async def caller() -> Any:
        entered.set()
        # infer enqueues before its first suspension, in this same step.
        return await batcher.infer(floats(1), SPEC, 30.0)

    waiting = asyncio.create_task(caller())
    await entered.wait()
    await batcher.close()
    with pytest.raises(errors.TritonUnavailable):
        await waiting
    assert pool.sent == []


class HeldPool(EchoPool):
    """An echo pool that answers only once released: a batch stays sent meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.called = asyncio.Event()
        self.release = asyncio.Event()

    async def infer(self, request: Any, timeout_s: float) -> Any:
        self.called.set()
        await self.release.wait()
        return await super().infer(request, timeout_s)


async def test_records_wait_for_their_batch_then_are_sent() -> None:
    """A request waiting for company says waiting_batch; once its batch leaves, both say sent."""
    pool = HeldPool()
    batcher = MicroBatcher(pool, max_batch_size=2, delay_s=10.0)  # type: ignore[arg-type]
    first, second = InFlight("in", 0, 1, 0.0), InFlight("in", 0, 2, 0.0)
    waiting = asyncio.create_task(batcher.infer(floats(1), SPEC, 5.0, inflight=first))
    await asyncio.sleep(0)  # one loop turn: the task runs up to its wait for the batch
    assert first.state == "waiting_batch" and not pool.called.is_set()
    filling = asyncio.create_task(batcher.infer(floats(1, start=4), SPEC, 5.0, inflight=second))
    await pool.called.wait()  # the batch is full (2 rows): it left at once
    assert (first.state, second.state) == ("sent", "sent")
    pool.release.set()
    await asyncio.gather(waiting, filling)
    assert pool.sent == [2]
    await batcher.close()
