"""Micro-batching against a real Triton: batched answers equal unbatched ones, poison isolated."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from devtools.samples import Tensor
from tests.support import decode_sample, mlp_reference
from worker import errors, wire
from worker.triton.batching import MicroBatcher
from worker.triton.pool import TritonPool
from worker.wire.tensors import deserialize_bytes_tensor, raw_to_numpy, serialize_bytes_tensor

# The worker's Kafka client plays no part here: run in the aiokafka passes only.
pytestmark = [pytest.mark.timeout(60), pytest.mark.one_client]


def floats(model: str, rows: np.ndarray[Any, Any], rid: str) -> wire.DecodedRequest:
    return decode_sample(model, [Tensor("INPUT0", "FP32", rows.shape, rows)], rid)


def output(response: Any, index: int = 0) -> np.ndarray[Any, Any]:
    tensor = response.outputs[index]
    return raw_to_numpy(tensor.datatype, list(tensor.shape), response.raw_output_contents[index])


async def test_batched_double_equals_unbatched(pool: TritonPool) -> None:
    """40 double requests of 1-3 rows, batched, give the same numbers as sent alone."""
    rng = np.random.default_rng(5)
    rows = [
        rng.standard_normal((int(rng.integers(1, 4)), 16)).astype(np.float32) for _ in range(40)
    ]
    spec = await pool.model_spec("double", "")
    batcher = MicroBatcher(pool, max_batch_size=16, delay_s=0.05)
    batched = await asyncio.gather(
        *(batcher.infer(floats("double", r, f"b{i}"), spec, 10) for i, r in enumerate(rows))
    )
    alone = [
        await pool.infer(floats("double", r, f"a{i}").infer_request, 10) for i, r in enumerate(rows)
    ]
    for r, got, want in zip(rows, batched, alone, strict=True):
        assert got.model_name == want.model_name == "double"
        assert got.model_version == want.model_version
        assert [o.name for o in got.outputs] == [o.name for o in want.outputs]
        np.testing.assert_array_equal(output(got), output(want))
        np.testing.assert_array_equal(output(got), r * 2)
    assert batcher.stats.batches >= 1
    assert batcher.stats.batches < len(rows)
    await batcher.close()


async def test_batched_mlp_matches_the_reference(pool: TritonPool) -> None:
    """64 one-row mlp requests batched by 32 give the reference probabilities."""
    rng = np.random.default_rng(9)
    rows = [rng.standard_normal((1, 64)).astype(np.float32) for _ in range(64)]
    spec = await pool.model_spec("mlp", "")
    batcher = MicroBatcher(pool, max_batch_size=32, delay_s=0.05)
    responses = await asyncio.gather(
        *(batcher.infer(floats("mlp", r, f"m{i}"), spec, 10) for i, r in enumerate(rows))
    )
    for r, response in zip(rows, responses, strict=True):
        assert list(response.outputs[0].shape) == [1, 10]
        np.testing.assert_allclose(output(response), mlp_reference(r), rtol=1e-5, atol=1e-6)
    assert batcher.stats.rows == 64
    assert batcher.stats.batches == 2
    await batcher.close()


async def test_a_full_batch_leaves_without_waiting_for_the_delay(pool: TritonPool) -> None:
    """With a 30 s delay, 8 requests that fill a batch of 8 are answered at once."""
    spec = await pool.model_spec("double", "")
    batcher = MicroBatcher(pool, max_batch_size=8, delay_s=30.0)
    rows = [np.full((1, 4), i, np.float32) for i in range(8)]
    responses = await asyncio.wait_for(
        asyncio.gather(
            *(batcher.infer(floats("double", r, f"f{i}"), spec, 20) for i, r in enumerate(rows))
        ),
        timeout=10,
    )
    assert [float(output(r)[0, 0]) for r in responses] == [2.0 * i for i in range(8)]
    assert batcher.stats.batches == 1
    await batcher.close()


async def test_requests_of_different_widths_are_not_mixed(pool: TritonPool) -> None:
    """double requests of width 4 and 8 travel in separate batches and come back intact."""
    spec = await pool.model_spec("double", "")
    batcher = MicroBatcher(pool, max_batch_size=64, delay_s=0.05)
    rows = [np.full((1, 4 if i % 2 else 8), i, np.float32) for i in range(10)]
    responses = await asyncio.gather(
        *(batcher.infer(floats("double", r, f"w{i}"), spec, 10) for i, r in enumerate(rows))
    )
    for r, response in zip(rows, responses, strict=True):
        np.testing.assert_array_equal(output(response), r * 2)
    assert batcher.stats.batches == 2
    await batcher.close()


async def test_a_poison_pill_fails_alone_inside_a_real_batch(pool: TritonPool) -> None:
    """echo_bytes fails a whole batch holding invalid UTF-8; bisection isolates that request."""
    spec = await pool.model_spec("echo_bytes", "")
    batcher = MicroBatcher(pool, max_batch_size=8, delay_s=0.5)
    words: list[bytes] = [f"word {i}".encode() for i in range(8)]
    words[3] = b"\xff\xfe not utf-8"
    requests = []
    for i, word in enumerate(words):
        # Tensor.raw() would encode str; build the invalid bytes directly.
        request = decode_sample("echo_bytes", [Tensor("TEXT", "BYTES", (1, 1), ["x"])], f"p{i}")
        del request.infer_request.raw_input_contents[:]
        request.infer_request.raw_input_contents.append(serialize_bytes_tensor([word]))
        requests.append(request)
    results = await asyncio.gather(
        *(batcher.infer(r, spec, 10) for r in requests), return_exceptions=True
    )
    assert isinstance(results[3], errors.InferenceError)
    assert not results[3].retryable
    for i, result in enumerate(results):
        if i == 3:
            continue
        assert not isinstance(result, BaseException), result
        assert deserialize_bytes_tensor(result.raw_output_contents[0]) == [words[i].upper()]
    assert batcher.stats.bisections >= 3
    await batcher.close()
