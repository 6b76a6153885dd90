"""System shared memory for large tensors against the session's real Triton."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from devtools import samples
from devtools.samples import ENCODINGS, SampleRequest, encode_request
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    result_outputs,
    running_worker,
    send,
    settings_for,
)
from worker.triton.pool import TritonPool

pytestmark = pytest.mark.timeout(60)

_ELEMENTS = 512 * 1024  # 2 MiB of FP32


def _double_request(values: np.ndarray[Any, Any]) -> Any:
    request = service_pb2.ModelInferRequest(model_name="double")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, values.size])
    request.raw_input_contents.append(values.astype("<f4").tobytes())
    return request


async def _doubled(pool: TritonPool, values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    response = await pool.infer(_double_request(values), 30)
    return np.frombuffer(response.raw_output_contents[0], dtype="<f4")


async def test_large_tensor_through_shared_memory_gives_the_grpc_result(
    triton: TritonUnderTest,
) -> None:
    """A 2 MiB tensor sent via a registered region equals the same tensor sent over gRPC."""
    values = np.random.default_rng(3).standard_normal(_ELEMENTS).astype(np.float32)
    plain = TritonPool(triton.grpc_address, 1)
    shm = TritonPool(triton.grpc_address, 1, shm_min_bytes=1 << 20, shm_pool_bytes=16 << 20)
    await plain.start()
    await shm.start()
    try:
        expected = await _doubled(plain, values)
        first = await _doubled(shm, values)
        second = await _doubled(shm, values[::-1].copy())
        assert shm.shm is not None
        assert shm.shm.enabled
        assert shm.shm.tensors_sent == 2
        # The region of the first request was reused by the second.
        assert shm.shm.allocated_bytes == 2 << 20
    finally:
        await plain.close()
        await shm.close()
    np.testing.assert_array_equal(first, expected)
    np.testing.assert_array_equal(first, values * 2)
    np.testing.assert_array_equal(second, values[::-1] * 2)
    assert shm.shm.allocated_bytes == 0


async def test_small_tensors_and_a_full_pool_stay_on_grpc(triton: TritonUnderTest) -> None:
    """Tensors under the threshold, or beyond the pool's room, travel as raw gRPC bytes."""
    values = np.arange(_ELEMENTS, dtype=np.float32)
    pool = TritonPool(triton.grpc_address, 1, shm_min_bytes=4 << 20, shm_pool_bytes=4 << 20)
    await pool.start()
    try:
        small = await _doubled(pool, values)
        assert pool.shm is not None
        assert pool.shm.tensors_sent == 0
        big = np.concatenate([values, values, values])  # 6 MiB: needs an 8 MiB region
        large = await _doubled(pool, big)
        assert pool.shm.tensors_sent == 0
        assert pool.shm.allocated_bytes == 0
    finally:
        await pool.close()
    np.testing.assert_array_equal(small, values * 2)
    np.testing.assert_array_equal(large, big * 2)


async def test_worker_with_system_shm_answers_every_encoding_correctly(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """WORKER_TRITON_SHM=system with a 1-byte threshold: every input via shm, same results."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    rng = np.random.default_rng(5)
    requests, expected = [], {}
    for encoding in ENCODINGS:
        for i in range(4):
            rid = f"shm-{encoding}-{i}"
            tensors = samples.double_inputs(rng, batch=2)
            value, headers = encode_request("double", tensors, encoding, rid)
            requests.append(SampleRequest(value, headers, "double", encoding, rid))
            expected[rid] = np.asarray(tensors[0].values) * 2
    settings = settings_for(kafka, triton, topics, triton_shm="system", shm_min_bytes="1")
    async with running_worker(settings) as worker:
        await send(kafka.bootstrap_servers, topics.input, requests)
        got = await collect(kafka.bootstrap_servers, topics, len(requests))
        assert worker.pool.shm is not None
        sent_via_shm = worker.pool.shm.tensors_sent
    assert got.dead_letters == {}
    assert sent_via_shm >= 1  # batched requests share a region; each Triton request used one
    for rid, values in expected.items():
        outputs = result_outputs(got.results[rid])
        np.testing.assert_allclose(np.asarray(outputs["OUTPUT0"]).reshape(values.shape), values)
