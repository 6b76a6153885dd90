"""A worker killed while token streams are being published one response at a time.

Real Kafka, real Triton, the worker as a process: ``WORKER_STREAM_OUTPUT=each``
with the ``tokens`` model, SIGKILL while streams are half published, then a new
worker finishes the work.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiokafka.structs import TopicPartition

from devtools.samples import expected_tokens, token_request
from tests.support import (
    KafkaUnderTest,
    Streams,
    Topics,
    TritonUnderTest,
    collect_streams,
    create,
    headers_dict,
    result_outputs,
    send,
    spawn_worker,
    worker_env,
)

pytestmark = pytest.mark.timeout(180)

TEXT = "one two three four five six seven"
TOKENS = 20
REQUESTS = 16


def _report(scenario: str, got: Streams, repeated: int) -> None:
    """A line of the reliability page's table (visible with ``pytest -s``)."""
    results = sum(map(len, got.results.values()))
    print(
        f"\nRELIABILITY | {scenario} | {REQUESTS} x {TOKENS} | 0 | {results - REQUESTS * TOKENS} "
        f"results ({repeated} requests redone) | {len(got.dead_letters)} | - |"
    )


def _index(record: Any) -> int:
    return int(headers_dict(record.headers)["x-response-index"])


def _token(record: Any) -> str:
    [token] = result_outputs(record)["text_output"]
    return str(token)


async def _kill_mid_stream(
    kafka: KafkaUnderTest, topics: Topics, env: dict[str, str], tmp_path: Path
) -> tuple[Streams, dict[TopicPartition, int]]:
    """Run a worker until a third of the responses are out; SIGKILL it; what it left."""
    first = spawn_worker(env, tmp_path / "first.log")

    def kill_at_a_third(got: Streams) -> bool:
        # Killed as soon as the reader sees it, so what was read is what it left.
        if sum(map(len, got.results.values())) < REQUESTS * TOKENS // 3:
            return False
        first.send_signal(signal.SIGKILL)
        return True

    try:
        seen = await collect_streams(
            kafka.bootstrap_servers, topics, [], timeout_s=90, until=kill_at_a_third
        )
        assert await asyncio.to_thread(first.wait, 30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    return seen, await kafka.committed_offsets(topics.group)


async def _finish(
    kafka: KafkaUnderTest, topics: Topics, env: dict[str, str], tmp_path: Path
) -> Streams:
    """A second worker until every stream is complete; stopped gracefully."""
    second = spawn_worker(env, tmp_path / "second.log")
    try:
        got = await collect_streams(
            kafka.bootstrap_servers, topics, [f"s{i}" for i in range(REQUESTS)], timeout_s=120
        )
        second.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(second.wait, 60) == 0
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    return got


async def _produce(kafka: KafkaUnderTest, topics: Topics) -> None:
    requests = [token_request(f"s{i}", TEXT, TOKENS, delay_ms=15) for i in range(REQUESTS)]
    await send(kafka.bootstrap_servers, topics.input, requests)


async def test_sigkill_mid_stream_loses_no_response_and_redoes_only_unfinished_requests(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """each, at_least_once, SIGKILL mid-stream: every response arrives; repeats only redone."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    await _produce(kafka, topics)
    env = worker_env(
        kafka, triton, topics, stream_output="each", max_in_flight="4", commit_interval_ms="100"
    )
    seen, committed = await _kill_mid_stream(kafka, topics, env, tmp_path)
    got = await _finish(kafka, topics, env, tmp_path)

    expected = expected_tokens(TEXT, TOKENS)
    partial_at_kill = {rid for rid in seen.results if not seen.finished(rid)}
    assert partial_at_kill, "the kill landed between streams, not mid-stream"
    committed_upto = committed.get(TopicPartition(topics.input, 0), 0)
    repeated = set()
    for i in range(REQUESTS):
        records = got.results[f"s{i}"]
        by_index = {_index(r): _token(r) for r in records}
        assert [by_index[j] for j in range(TOKENS)] == expected, f"s{i}"  # none lost
        if max(Counter(map(_index, records)).values()) > 1:
            repeated.add(i)
    # Only requests the first worker had not committed were redone, and each redone
    # request was published again from its first response, in order.
    assert repeated <= set(range(committed_upto, REQUESTS))
    assert {int(rid[1:]) for rid in partial_at_kill} <= repeated
    assert got.dead_letters == {}
    _report("token streams, `each`, worker SIGKILL mid-stream", got, len(repeated))


async def test_exactly_once_sigkill_mid_stream_never_shows_a_partial_stream(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """each, exactly_once, SIGKILL: read_committed sees each stream whole, exactly once."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    await _produce(kafka, topics)
    env = worker_env(
        kafka,
        triton,
        topics,
        stream_output="each",
        delivery="exactly_once",
        max_in_flight="4",
        commit_interval_ms="100",
    )
    seen, _ = await _kill_mid_stream(kafka, topics, env, tmp_path)
    for rid, records in seen.results.items():  # whole, or not there at all
        assert [_index(r) for r in records] == list(range(TOKENS)), rid
    assert len(seen.results) < REQUESTS, "every stream was done before the kill"
    got = await _finish(kafka, topics, env, tmp_path)

    expected = expected_tokens(TEXT, TOKENS)
    for i in range(REQUESTS):
        records = got.results[f"s{i}"]
        assert [_index(r) for r in records] == list(range(TOKENS)), f"s{i}"
        assert [_token(r) for r in records] == expected
    assert got.dead_letters == {}
    _report("token streams, `each`, `exactly_once`, SIGKILL (`read_committed`)", got, 0)
