"""Sequences keyed by Kafka key: the stateful ``running_sum`` model through the worker.

Real Kafka, real Triton: ``running_sum`` sits behind Triton's sequence batcher
(at most 8 sequences at once) and answers each request with the running sum of
its sequence, so a sum is right only if every earlier request of the sequence
reached Triton first, in order, under the same correlation id.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest

from devtools.samples import ENCODINGS, SampleRequest, running_sum_request
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect_streams,
    create,
    headers_dict,
    result_outputs,
    running_worker,
    send,
    settings_for,
)

pytestmark = pytest.mark.timeout(120)


def _sum(record: Any) -> int:
    return int(result_outputs(record)["SUM"].reshape(-1)[0])


async def _answered(
    kafka: KafkaUnderTest,
    triton: TritonUnderTest,
    unique: str,
    requests: Sequence[SampleRequest],
    keys: Sequence[bytes | None],
) -> Any:
    """The requests, keyed as given, through a worker taking sequence ids from keys;
    every one's result or dead letter."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    settings = settings_for(kafka, triton, topics, sequence_from_key="true")
    async with running_worker(settings):
        await send(kafka.bootstrap_servers, topics.input, requests, keys=keys)
        return await collect_streams(
            kafka.bootstrap_servers, topics, [request.request_id for request in requests]
        )


async def test_sums_are_right_per_key_with_many_keys_in_flight(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """12 keys (more than Triton's 8 sequence slots) interleaved on 2 partitions: every sum."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    keys = [f"user-{k}" for k in range(12)]
    steps = 5
    requests: list[SampleRequest] = []
    record_keys: list[bytes | None] = []
    expected: dict[str, int] = {}
    # Round-robin over keys, so records of every key are in flight together.
    for step, (k, key) in itertools.product(range(steps), enumerate(keys)):
        rid = f"{key}-{step}"
        value = (k + 1) * 10 + step
        encoding = ENCODINGS[(k + step) % len(ENCODINGS)]
        requests.append(
            running_sum_request(rid, value, encoding, start=step == 0, end=step == steps - 1)
        )
        record_keys.append(key.encode())
        expected[rid] = sum((k + 1) * 10 + s for s in range(step + 1))

    settings = settings_for(kafka, triton, topics, sequence_from_key="true")
    async with running_worker(settings):
        await send(kafka.bootstrap_servers, topics.input, requests, keys=record_keys)
        got = await collect_streams(kafka.bootstrap_servers, topics, list(expected))

    assert got.dead_letters == {}
    assert {rid: _sum(records[0]) for rid, records in got.results.items()} == expected


async def test_start_and_end_bound_a_sequence_and_a_key_can_start_again(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """One key, two sequences back to back: the sum restarts at x-sequence-start."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    values = [(1, True, False), (2, False, False), (3, False, True), (10, True, False)]
    values += [(20, False, True)]
    requests = [
        running_sum_request(f"again-{i}", v, start=start, end=end)
        for i, (v, start, end) in enumerate(values)
    ]
    settings = settings_for(kafka, triton, topics, sequence_from_key="true")
    async with running_worker(settings):
        await send(kafka.bootstrap_servers, topics.input, requests, keys=[b"same"] * len(values))
        got = await collect_streams(
            kafka.bootstrap_servers, topics, [r.request_id for r in requests]
        )

    assert [_sum(got.results[r.request_id][0]) for r in requests] == [1, 3, 6, 10, 30]


async def test_keyless_and_unstarted_sequences_are_dead_lettered_not_retried(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """No key: INVALID_REQUEST saying why; a key Triton has no sequence for: INFERENCE_ERROR."""
    keyless = running_sum_request("keyless", 5, start=True)
    # Triton answers a sequence it dropped (idle timeout, restart) as one never started.
    unstarted = running_sum_request("unstarted", 5)
    good = running_sum_request("good", 7, start=True, end=True)
    got = await _answered(
        kafka, triton, unique, [keyless, unstarted, good], [None, b"never-started", b"fine"]
    )

    assert _sum(got.results["good"][0]) == 7
    headers = headers_dict(got.dead_letters["keyless"][0].headers)
    assert headers["x-error-code"] == b"INVALID_REQUEST"
    assert b"needs a key" in headers["x-error-message"]
    headers = headers_dict(got.dead_letters["unstarted"][0].headers)
    assert headers["x-error-code"] == b"INFERENCE_ERROR"
    assert headers["x-attempts"] == b"1"
    assert b"must specify the START flag" in headers["x-error-message"]


async def test_steps_of_lost_sequences_never_trip_the_models_breaker(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """After a restart of Triton every live sequence's next step fails, as one never
    started: each is its own dead letter, however many, and the model's failure-rate
    breaker (which trips on more than half of 20 failing) stays closed, so a sequence
    started after them is answered and no step is held for good."""
    lost = [running_sum_request(f"lost-{i}", 1) for i in range(30)]
    good = running_sum_request("good", 7, start=True, end=True)
    keys = [*(f"lost-{i}".encode() for i in range(30)), b"good"]
    got = await _answered(kafka, triton, unique, [*lost, good], keys)

    assert _sum(got.results["good"][0]) == 7
    for i in range(30):
        (dead,) = got.dead_letters[f"lost-{i}"]
        headers = headers_dict(dead.headers)
        assert headers["x-error-code"] == b"INFERENCE_ERROR"
        assert b"must specify the START flag" in headers["x-error-message"]
