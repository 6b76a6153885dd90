"""Decoupled models end to end: the ``tokens`` token stream through the worker, both modes.

Real Kafka, real Triton: the ``tokens`` model streams one response per token, the
final flag on the last token, or alone after it (``separate_final``), or alone for
zero tokens; ``fail_after`` makes it send an error response midway. Ordinary
requests flow beside them through the same worker and pool (decoupled requests
have streams of their own: shared ones crashed tritonserver 2.51, see docs/decisions/0009).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from devtools.samples import (
    ENCODINGS,
    SampleRequest,
    encode_request,
    expected_tokens,
    token_request,
)
from devtools.samples import Tensor as SampleTensor
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

TEXT = "the quick brown fox jumps"


def _double(request_id: str) -> SampleRequest:
    values = np.arange(4, dtype=np.float32).reshape(1, 4)
    value, headers = encode_request(
        "double", [SampleTensor("INPUT0", "FP32", (1, 4), values)], "json", request_id
    )
    return SampleRequest(value, headers, "double", "json", request_id)


def _mixed_requests() -> tuple[list[SampleRequest], dict[str, list[str]]]:
    """Token streams of every shape, in every encoding, between ordinary requests."""
    requests: list[SampleRequest] = []
    expected: dict[str, list[str]] = {}
    for encoding in ENCODINGS:
        for name, count, separate in (("seven", 7, False), ("apart", 3, True), ("none", 0, False)):
            rid = f"{name}-{encoding}"
            requests.append(token_request(rid, TEXT, count, encoding, separate_final=separate))
            expected[rid] = expected_tokens(TEXT, count)
            requests.append(_double(f"double-{rid}"))
    return requests, expected


def _text(record: Any) -> list[str]:
    outputs = result_outputs(record)
    return list(outputs.get("text_output", []))


def _histogram(worker: Any, name: str, model: str) -> tuple[float, float]:
    """(count, sum) of a histogram of ``model`` in the worker's registry."""
    registry = worker.metrics.registry
    labels = {"model": model}
    count = registry.get_sample_value(f"{name}_count", labels) or 0.0
    total = registry.get_sample_value(f"{name}_sum", labels) or 0.0
    return count, total


async def test_final_mode_joins_every_response_in_order_beside_ordinary_requests(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """final: one result per stream, BYTES [N] pieces in order, x-response-count, metrics."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    requests, expected = _mixed_requests()
    settings = settings_for(kafka, triton, topics)
    async with running_worker(settings) as worker:
        await send(kafka.bootstrap_servers, topics.input, requests)
        got = await collect_streams(
            kafka.bootstrap_servers, topics, [r.request_id for r in requests]
        )
        responses = _histogram(worker, "worker_stream_responses", "tokens")
        first = _histogram(worker, "worker_stream_first_response_seconds", "tokens")

    assert got.dead_letters == {}
    for rid, tokens in expected.items():
        [record] = got.results[rid]
        headers = headers_dict(record.headers)
        assert _text(record) == tokens, rid
        assert headers["x-response-count"] == str(len(tokens)).encode(), rid
        assert "x-response-index" not in headers
        [ordinary] = got.results[f"double-{rid}"]
        np.testing.assert_allclose(result_outputs(ordinary)["OUTPUT0"], [[0, 2, 4, 6]])
    streams = len(expected)
    assert responses == (streams, sum(len(t) for t in expected.values()))
    assert first[0] == streams


async def test_each_mode_publishes_every_response_in_order_as_its_own_result(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """each: a result per response, same key and partition, indexes 0.., final on the last."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    requests, expected = _mixed_requests()
    settings = settings_for(kafka, triton, topics, stream_output="each")
    async with running_worker(settings):
        await send(kafka.bootstrap_servers, topics.input, requests)
        got = await collect_streams(
            kafka.bootstrap_servers, topics, [r.request_id for r in requests]
        )

    assert got.dead_letters == {}
    for rid, tokens in expected.items():
        records = got.results[rid]
        # The final flag alone (after the tokens, or for none) is a result of its own.
        alone = rid.startswith(("apart", "none"))
        assert len(records) == len(tokens) + alone, rid
        assert [_text(r) for r in records] == [[t] for t in tokens] + ([[]] if alone else [])
        assert {r.key for r in records} == {rid.encode()}
        assert len({r.partition for r in records}) == 1
        assert [r.offset for r in records] == sorted(r.offset for r in records)
        for index, record in enumerate(records):
            headers = headers_dict(record.headers)
            last = index == len(records) - 1
            assert headers["x-response-index"] == str(index).encode()
            assert headers["x-response-final"] == (b"true" if last else b"false")
            assert ("x-response-count" in headers) == last
        assert headers_dict(records[-1].headers)["x-response-count"] == str(len(records)).encode()
        assert len(got.results[f"double-{rid}"]) == 1


async def test_joined_bytes_make_one_string_per_stream(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """final with WORKER_STREAM_JOIN_BYTES: the pieces joined into the generated text."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    requests = [token_request(f"joined-{e}", TEXT, 8, e) for e in ENCODINGS]
    settings = settings_for(kafka, triton, topics, stream_join_bytes="true")
    async with running_worker(settings):
        await send(kafka.bootstrap_servers, topics.input, requests)
        got = await collect_streams(
            kafka.bootstrap_servers, topics, [r.request_id for r in requests]
        )

    for request in requests:
        [record] = got.results[request.request_id]
        assert _text(record) == ["the quick brown fox jumps the quick brown"]
        assert headers_dict(record.headers)["x-response-count"] == b"8"


async def test_a_failure_after_k_responses_is_an_inference_error_in_both_modes(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """fail_after 3: final dead-letters it (3 received); each publishes 3, then the letter."""
    final_topics, each_topics = Topics.fresh(f"{unique}-f"), Topics.fresh(f"{unique}-e")
    await asyncio.gather(create(kafka, final_topics), create(kafka, each_topics))
    request = token_request("fails", TEXT, 6, fail_after=3)
    async with (
        running_worker(settings_for(kafka, triton, final_topics)),
        running_worker(settings_for(kafka, triton, each_topics, stream_output="each")),
    ):
        await send(kafka.bootstrap_servers, final_topics.input, [request])
        await send(kafka.bootstrap_servers, each_topics.input, [request])
        final, each = await asyncio.gather(
            collect_streams(kafka.bootstrap_servers, final_topics, ["fails"]),
            collect_streams(kafka.bootstrap_servers, each_topics, ["fails"]),
        )

    [letter] = final.dead_letters["fails"]
    headers = headers_dict(letter.headers)
    assert final.results == {}
    assert headers["x-error-code"] == b"INFERENCE_ERROR"
    assert b"failure requested after 3 tokens" in headers["x-error-message"]
    assert headers["x-responses-received"] == b"3"
    assert headers["x-attempts"] == b"1"
    assert letter.value == request.value

    assert [_text(r) for r in each.results["fails"]] == [[t] for t in expected_tokens(TEXT, 3)]
    assert [headers_dict(r.headers)["x-response-final"] for r in each.results["fails"]] == [
        b"false"
    ] * 3
    [letter] = each.dead_letters["fails"]
    headers = headers_dict(letter.headers)
    assert headers["x-error-code"] == b"INFERENCE_ERROR"
    assert headers["x-responses-published"] == b"3"
    assert headers["x-responses-received"] == b"3"
    assert b"not retried: 3 result(s)" in headers["x-error-message"]


async def test_a_gap_longer_than_the_idle_timeout_ends_the_stream_in_both_modes(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Tokens 600 ms apart, idle timeout 250 ms: final retries then gives up; each stops."""
    final_topics, each_topics = Topics.fresh(f"{unique}-f"), Topics.fresh(f"{unique}-e")
    await asyncio.gather(create(kafka, final_topics), create(kafka, each_topics))
    slow = token_request("slow", TEXT, 3, delay_ms=600)
    brisk = token_request("brisk", TEXT, 5, delay_ms=20)
    extra = {"stream_idle_timeout_ms": "250", "max_attempts": "2", "retry_backoff_ms": "10"}
    async with (
        running_worker(settings_for(kafka, triton, final_topics, **extra)),
        running_worker(settings_for(kafka, triton, each_topics, stream_output="each", **extra)),
    ):
        await send(kafka.bootstrap_servers, final_topics.input, [slow, brisk])
        await send(kafka.bootstrap_servers, each_topics.input, [slow, brisk])
        final, each = await asyncio.gather(
            collect_streams(kafka.bootstrap_servers, final_topics, ["slow", "brisk"]),
            collect_streams(kafka.bootstrap_servers, each_topics, ["slow", "brisk"]),
        )

    # Gaps under the idle timeout are fine, however long the whole stream.
    assert _text(final.results["brisk"][0]) == expected_tokens(TEXT, 5)
    assert len(each.results["brisk"]) == 5
    # final: a timeout is retryable, so the whole request was tried twice.
    [letter] = final.dead_letters["slow"]
    headers = headers_dict(letter.headers)
    assert headers["x-error-code"] == b"RETRIES_EXHAUSTED"
    assert headers["x-attempts"] == b"2"
    assert b"WORKER_STREAM_IDLE_TIMEOUT_MS" in headers["x-error-message"]
    assert headers["x-responses-received"] == b"1"
    assert "slow" not in final.results
    # each: the first token was published, so no retry: one try, one result, the letter.
    assert [_text(r) for r in each.results["slow"]] == [["the"]]
    [letter] = each.dead_letters["slow"]
    headers = headers_dict(letter.headers)
    assert headers["x-error-code"] == b"RETRIES_EXHAUSTED"
    assert headers["x-attempts"] == b"1"
    assert headers["x-responses-published"] == b"1"
    assert b"not retried" in headers["x-error-message"]
