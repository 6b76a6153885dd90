"""The fast path on real Kafka and Triton: a backlog takes it, a poison pill still fails alone.

``echo_bytes`` fails a whole request holding invalid UTF-8, so a micro-batch of the
fast path that carries one fails as a whole: its records go to the per-record path,
whose bisection isolates the pill (see tests/integration/test_batching.py).
"""

from __future__ import annotations

import pytest
from tritonclient.grpc import service_pb2

from devtools.samples import SampleRequest, Tensor, encode_request, good_requests
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    headers_dict,
    running_worker,
    send,
    settings_for,
)
from worker.app import Worker
from worker.records.steps import FALLBACK_REASONS
from worker.wire.tensors import serialize_bytes_tensor

pytestmark = pytest.mark.timeout(120)

_MLP_RECORDS = 300
_PILL = 7


def _words(count: int, pill: int) -> list[SampleRequest]:
    """``count`` echo_bytes requests (protobuf), the one at ``pill`` not valid UTF-8."""
    requests = []
    for i in range(count):
        rid = f"echo-{i}"
        value, headers = encode_request(
            "echo_bytes", [Tensor("TEXT", "BYTES", (1, 1), ["x"])], "protobuf", rid
        )
        infer = service_pb2.ModelInferRequest.FromString(value)
        word = b"\xff\xfe not utf-8" if i == pill else f"word {i}".encode()
        del infer.raw_input_contents[:]
        infer.raw_input_contents.append(serialize_bytes_tensor([word]))
        requests.append(
            SampleRequest(infer.SerializeToString(), headers, "echo_bytes", "protobuf", rid)
        )
    return requests


def _sample(worker: Worker, metric: str, **labels: str) -> float:
    return worker.metrics.registry.get_sample_value(metric, labels) or 0.0


async def test_a_backlog_takes_the_fast_path_and_a_poison_pill_fails_alone(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """mlp records answered by the fast path; the pill among echo_bytes neighbours is its own
    INFERENCE_ERROR dead letter after one counted attempt, every neighbour answered."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    warm = good_requests(2, seed=11, models=("mlp", "echo_bytes"))
    backlog = good_requests(_MLP_RECORDS, seed=12, models=("mlp",)) + _words(16, _PILL)
    async with running_worker(settings_for(kafka, triton, topics)) as worker:
        # 1. The first records of a model take the per-record path: it caches the spec.
        await send(kafka.bootstrap_servers, topics.input, warm)
        await collect(kafka.bootstrap_servers, topics, len(warm), timeout_s=60)
        assert _sample(worker, "worker_fast_path_records_total") == 0
        # 2. The rest of the traffic finds the specs cached.
        await send(kafka.bootstrap_servers, topics.input, backlog)
        got = await collect(kafka.bootstrap_servers, topics, len(warm) + len(backlog), 60)
        fast = _sample(worker, "worker_fast_path_records_total")
        fell_back = _sample(worker, "worker_fast_path_fallbacks_total", reason="inference")
        # Why records left the fast path, should some mlp record be among them.
        reasons = {
            reason: _sample(worker, "worker_fast_path_fallbacks_total", reason=reason)
            for reason in FALLBACK_REASONS
        }

    assert fast >= _MLP_RECORDS, (fast, reasons)
    assert fell_back >= 1
    assert set(got.dead_letters) == {f"echo-{_PILL}"}, sorted(got.dead_letters)
    headers = headers_dict(got.dead_letters[f"echo-{_PILL}"].headers)
    assert headers["x-error-code"] == b"INFERENCE_ERROR", headers
    # The fast path's try of the pill's micro-batch is not counted as an attempt.
    assert int(headers["x-attempts"]) == 1, headers
    expected = {r.request_id for r in warm + backlog} - {f"echo-{_PILL}"}
    assert set(got.results) == expected
    assert got.duplicates == 0
