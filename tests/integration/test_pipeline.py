"""The worker end to end on a real Kafka broker and a real Triton server."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from aiokafka.structs import TopicPartition

from devtools import samples
from devtools.samples import ENCODINGS, SampleRequest, encode_request, faulty_request
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    embedding_reference,
    headers_dict,
    mlp_reference,
    result_outputs,
    running_worker,
    send,
    settings_for,
)
from worker.flow.window import Window

pytestmark = pytest.mark.timeout(180)


def _expected(request_tensors: list[samples.Tensor], model: str) -> tuple[str, Any]:
    values = request_tensors[0].values
    if model == "double":
        return "OUTPUT0", np.asarray(values) * 2
    if model == "mlp":
        return "PROBS", mlp_reference(np.asarray(values, dtype=np.float32))
    if model == "embedding":
        return "PROBS", embedding_reference(np.asarray(values, dtype=np.float32))
    return "TEXT_UPPER", [str(v).upper() for v in values]


async def test_every_model_every_encoding_gets_correct_results(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Each model in JSON, binary and protobuf: right values, key, pass-through headers."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    rng = np.random.default_rng(11)
    cases: dict[str, tuple[str, list[samples.Tensor], str]] = {}
    requests = []
    for model, make in samples.MODEL_INPUTS.items():
        for encoding in ENCODINGS:
            rid = f"{model}-{encoding}"
            tensors = make(rng)
            value, request_headers = encode_request(model, tensors, encoding, rid)
            request_headers.append(("trace-id", rid.encode()))
            requests.append(SampleRequest(value, request_headers, model, encoding, rid))
            cases[rid] = (model, tensors, encoding)

    async with running_worker(settings_for(kafka, triton, topics)):
        await send(kafka.bootstrap_servers, topics.input, requests)
        got = await collect(kafka.bootstrap_servers, topics, len(requests))

    assert got.dead_letters == {}
    for rid, (model, tensors, _encoding) in cases.items():
        record = got.results[rid]
        assert record.key == rid.encode()
        headers = headers_dict(record.headers)
        assert headers["trace-id"] == rid.encode()
        assert headers["x-model-name"] == model.encode()
        assert headers["x-model-version"] == b"1"
        assert headers["x-source-topic"] == topics.input.encode()
        assert int(headers["x-source-offset"]) >= 0
        name, expected = _expected(tensors, model)
        outputs = result_outputs(record)
        if model == "echo_bytes":
            assert outputs[name] == expected, (rid, outputs[name])
        else:
            np.testing.assert_allclose(
                np.asarray(outputs[name]).reshape(expected.shape), expected, rtol=1e-5, err_msg=rid
            )


async def test_bad_inputs_get_one_dead_letter_each_and_good_ones_flow(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Each bad input: one dead letter, right code, original bytes; good ones flow around."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=1)
    limit = 64 * 1024
    bad = samples.bad_requests(limit)
    good = samples.good_requests(30, seed=5)
    mixed = [item for pair in zip(good, bad, strict=False) for item in pair] + good[len(bad) :]

    async with running_worker(settings_for(kafka, triton, topics, max_request_bytes=str(limit))):
        await send(kafka.bootstrap_servers, topics.input, mixed)
        got = await collect(kafka.bootstrap_servers, topics, len(mixed))

    assert got.duplicates == 0
    assert set(got.results) == {r.request_id for r in good}
    assert set(got.dead_letters) == {r.request_id for r in bad}
    for request in bad:
        letter = got.dead_letters[request.request_id]
        headers = headers_dict(letter.headers)
        assert headers["x-error-code"].decode() == request.expected_code, request.request_id
        assert letter.value == request.value, request.request_id
        assert letter.key == request.request_id.encode()
        assert headers["x-error-retryable"] == b"false"
        assert headers["x-consumer-group"] == topics.group.encode()
        assert 0 < len(headers["x-error-message"]) <= 1024
        for name, value in request.headers:
            assert (name, value) in letter.headers
        for name in (
            "x-attempts",
            "x-source-topic",
            "x-source-partition",
            "x-source-offset",
            "x-source-timestamp",
            "x-failed-at",
        ):
            assert name in headers, (request.request_id, name)


def _slow_and_fast(rng: np.random.Generator, slow_ms: int, fast: int) -> list[SampleRequest]:
    slow = faulty_request(rng, "slow-0", delay_ms=slow_ms)
    return [slow] + [faulty_request(rng, f"fast-{i}") for i in range(1, fast + 1)]


async def test_commit_never_passes_an_unfinished_record(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Later offsets finish first; the committed offset stays at the slow one until it is done."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=1)
    tp = TopicPartition(topics.input, 0)
    requests = _slow_and_fast(np.random.default_rng(2), slow_ms=4000, fast=20)

    async with running_worker(settings_for(kafka, triton, topics)) as worker:
        await send(kafka.bootstrap_servers, topics.input, requests)
        # Triton answers each stream in request order, so only the fast requests
        # on the other stream(s) can overtake the slow one: wait for some of them.
        got = await collect(kafka.bootstrap_servers, topics, expected=5)
        assert "slow-0" not in got.results, "the slow request finished too early for this test"
        await worker.delivery.commit()
        while_slow = await kafka.committed_offsets(topics.group)
        assert worker.delivery.offsets.pending(tp) >= 1  # the slow one is still in flight
        got = await collect(kafka.bootstrap_servers, topics, expected=21, into=got)
        # A result can be read before its record is marked done: wait for the slots.
        await asyncio.wait_for(worker.window.wait_empty(tp), 30)
        await worker.delivery.commit()
        after = await kafka.committed_offsets(topics.group)

    assert while_slow.get(tp, 0) == 0
    assert after[tp] == 21


class _SpyWindow(Window):
    """The real window, recording the most slots ever held at once."""

    peak = 0

    def try_acquire(self, key: Any) -> bool:
        acquired = super().try_acquire(key)
        self.peak = max(self.peak, self.in_flight)
        return acquired


async def test_window_bounds_in_flight_and_pauses_fetching(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With WORKER_MAX_IN_FLIGHT=8 no more than 8 are in flight; fetching pauses and resumes."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    rng = np.random.default_rng(4)
    requests = [faulty_request(rng, f"w{i}", delay_ms=20) for i in range(120)]
    # A poll of 10: librdkafka's intake pauses a partition once a poll's worth waits.
    settings = settings_for(
        kafka,
        triton,
        topics,
        max_in_flight="8",
        max_in_flight_per_partition="8",
        max_poll_records="10",
    )
    from worker.app import Worker

    # The worker's one window, which the intake, the dispatcher and both paths share.
    monkeypatch.setattr("worker.app.Window", _SpyWindow)
    worker = Worker(settings)
    spy = worker.window
    assert isinstance(spy, _SpyWindow)
    paused_seen = asyncio.Event()
    # The paused-partitions gauge is set from the partitions the intake pauses, whichever
    # client runs; a value above 0 is a pause.
    gauge = worker.metrics.paused_partitions
    real_set = gauge.set

    def spy_set(value: float) -> None:
        if value > 0:
            paused_seen.set()
        real_set(value)

    gauge.set = spy_set  # type: ignore[method-assign]

    async with running_worker(settings, worker):
        await send(kafka.bootstrap_servers, topics.input, requests)
        got = await collect(kafka.bootstrap_servers, topics, len(requests))

    assert paused_seen.is_set(), "fetching never paused although the window was full"

    # All 120 answered although fetching paused: it resumed whenever slots freed.
    assert len(got.results) == 120
    assert 1 < spy.peak <= 8
