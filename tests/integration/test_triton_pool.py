"""The stream pool against a real Triton: correlation, deadlines, head-of-line avoidance."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from devtools.samples import faulty_inputs
from tests.support import decode_sample
from worker import errors
from worker.triton.pool import TritonPool

# The worker's Kafka client plays no part here: run in the aiokafka passes only.
pytestmark = [pytest.mark.timeout(60), pytest.mark.one_client]


def _faulty(rng: np.random.Generator, rid: str, delay_ms: int = 0, fail: bool = False) -> Any:
    tensors = faulty_inputs(rng, delay_ms=delay_ms, fail=fail)
    decoded = decode_sample("faulty", tensors, rid, encoding="json")
    return decoded.infer_request


async def test_fast_requests_avoid_a_stream_stuck_behind_a_slow_one(pool: TritonPool) -> None:
    """Once a slow request holds a stream, new requests go to the other stream."""
    rng = np.random.default_rng(1)
    slow = asyncio.create_task(pool.infer(_faulty(rng, "slow", delay_ms=3000), 10))
    started = time.monotonic()
    # Real round trips (not sleeps) until the slow request counts as stuck.
    while time.monotonic() - started < 0.3:
        await pool.infer(_faulty(rng, "probe"), 5)
    fast = [pool.infer(_faulty(rng, f"fast-{i}"), 5) for i in range(20)]
    responses = await asyncio.gather(*fast)
    assert not slow.done(), "every fast request should finish before the slow one"
    assert len(responses) == 20
    assert (await slow).outputs[0].name == "OUTPUT0"


async def test_deadline_raises_retryable_timeout_and_drops_the_late_answer(
    pool: TritonPool,
) -> None:
    """A request past its deadline fails as TritonTimeout; its late response is ignored."""
    rng = np.random.default_rng(2)
    with pytest.raises(errors.TritonTimeout) as caught:
        await pool.infer(_faulty(rng, "late", delay_ms=1500), 0.2)
    assert caught.value.retryable
    # The stream keeps working, and the late answer never surfaces as another's.
    response = await pool.infer(_faulty(rng, "after"), 5)
    assert response.outputs[0].name == "OUTPUT0"
    assert pool.in_flight() == 0


async def test_model_error_is_not_retryable(pool: TritonPool) -> None:
    """An error raised by the model is an INFERENCE_ERROR, not retried."""
    rng = np.random.default_rng(3)
    with pytest.raises(errors.WorkerError) as caught:
        await pool.infer(_faulty(rng, "boom", fail=True), 5)
    assert caught.value.code == "INFERENCE_ERROR"
    assert not caught.value.retryable


async def test_unknown_model_spec_is_model_not_found(pool: TritonPool) -> None:
    """Metadata of a model Triton lacks: MODEL_NOT_FOUND, not retryable."""
    with pytest.raises(errors.ModelNotFound):
        await pool.model_spec("no_such_model", "")
