"""The worker crashes, meets poison pills, slow models and a full window: nothing is lost."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from devtools import samples
from devtools.samples import faulty_request
from tests.support import (
    Collected,
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    headers_dict,
    report,
    running_worker,
    send,
    settings_for,
    spawn_worker,
    worker_env,
)
from tests.support.worker import kafka_client_under_test

pytestmark = pytest.mark.timeout(240)


async def _kill_and_restart(
    kafka: KafkaUnderTest,
    triton: TritonUnderTest,
    topics: Topics,
    tmp_path: Path,
    total: int,
    **extra: str,
) -> Collected:
    """Run a worker process, SIGKILL it mid-stream, run a new one until all is answered."""
    env = worker_env(kafka, triton, topics, commit_interval_ms="100", **extra)
    first = spawn_worker(env, tmp_path / "first.log")
    try:
        got = await collect(kafka.bootstrap_servers, topics, total // 3, timeout_s=90)
        first.send_signal(signal.SIGKILL)
        assert await asyncio.to_thread(first.wait, 30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    second = spawn_worker(env, tmp_path / "second.log")
    try:
        got = await collect(kafka.bootstrap_servers, topics, total, timeout_s=120)
        second.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(second.wait, 60) == 0
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    return got


async def test_sigkill_mid_stream_loses_nothing_and_duplicates_stay_bounded(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """SIGKILL a worker mid-stream, start another: all answered; duplicates ≤ window."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=4)
    requests = samples.good_requests(3000, seed=51, models=("double",))
    await send(kafka.bootstrap_servers, topics.input, requests)
    got = await _kill_and_restart(
        kafka, triton, topics, tmp_path, len(requests), max_in_flight="64"
    )
    assert set(got.results) == {r.request_id for r in requests}
    assert got.dead_letters == {}
    # Redone after the crash: what was in flight (≤ window) plus what finished after
    # the last commit (≤ one 100 ms commit interval of throughput).
    report("worker SIGKILL mid-stream, restarted", len(requests), got)
    assert got.duplicates <= 64 + 1000


async def test_exactly_once_survives_sigkill(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """exactly_once + SIGKILL: a read_committed reader sees every request id exactly once."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    requests = samples.good_requests(1500, seed=52, models=("double",))
    requests += samples.bad_requests()[:3]
    await send(kafka.bootstrap_servers, topics.input, requests)
    got = await _kill_and_restart(
        kafka,
        triton,
        topics,
        tmp_path,
        len(requests),
        delivery="exactly_once",
        max_request_bytes=str(samples.BAD_SAMPLES_MAX_REQUEST_BYTES),
    )
    report("exactly_once, worker SIGKILL mid-stream (read_committed)", len(requests), got)
    assert got.duplicates == 0
    assert set(got.results) | set(got.dead_letters) == {r.request_id for r in requests}
    assert set(got.dead_letters) == {r.request_id for r in requests if r.expected_code}


async def test_poison_pills_alone_are_dead_lettered(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Requests the model raises for are dead-lettered (INFERENCE_ERROR, once); others pass."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    rng = np.random.default_rng(6)
    requests = [faulty_request(rng, f"r{i}", fail=i % 10 == 3) for i in range(100)]
    async with running_worker(settings_for(kafka, triton, topics)):
        await send(kafka.bootstrap_servers, topics.input, requests)
        got = await collect(kafka.bootstrap_servers, topics, len(requests))
    poison = {f"r{i}" for i in range(100) if i % 10 == 3}
    report("poison pills (10 of 100 make the model raise)", len(requests), got)
    assert set(got.dead_letters) == poison
    for rid in poison:
        headers = headers_dict(got.dead_letters[rid].headers)
        assert headers["x-error-code"] == b"INFERENCE_ERROR"
        assert headers["x-attempts"] == b"1"
    assert len(got.results) == 90


async def test_slow_model_times_out_retries_then_dead_letters(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """A request slower than its timeout is retried max_attempts times, then RETRIES_EXHAUSTED."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=1)
    rng = np.random.default_rng(7)
    requests = [faulty_request(rng, "slow", delay_ms=1500), faulty_request(rng, "quick")]
    settings = settings_for(
        kafka,
        triton,
        topics,
        request_timeout_ms="300",
        max_attempts="3",
        retry_backoff_ms="10",
        retry_backoff_max_ms="20",
    )
    async with running_worker(settings) as worker:
        await send(kafka.bootstrap_servers, topics.input, requests)
        got = await collect(kafka.bootstrap_servers, topics, 2)
    report("slow model: timeouts, 3 tries, RETRIES_EXHAUSTED", len(requests), got)
    headers = headers_dict(got.dead_letters["slow"].headers)
    assert headers["x-error-code"] == b"RETRIES_EXHAUSTED"
    assert headers["x-attempts"] == b"3"
    assert headers["x-error-retryable"] == b"true"
    assert b"TRITON_TIMEOUT" in headers["x-error-message"]
    assert "quick" in got.results
    retries = worker.metrics.retries_total.labels(reason="TRITON_TIMEOUT")._value.get()
    assert retries == 2


async def test_window_full_past_max_poll_interval_keeps_membership(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """The window stays full longer than max_poll_interval_ms: no rebalance."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=1)
    rng = np.random.default_rng(8)
    # librdkafka wants max.poll.interval.ms >= session.timeout.ms (the broker's floor: 6 s).
    poll_ms, delay_ms = (6000, 7000) if kafka_client_under_test() == "confluent" else (1000, 3000)
    requests = [faulty_request(rng, f"s{i}", delay_ms=delay_ms) for i in range(4)]
    requests += [faulty_request(rng, f"q{i}") for i in range(20)]
    settings = settings_for(
        kafka,
        triton,
        topics,
        max_in_flight="2",
        max_in_flight_per_partition="2",
        max_poll_interval_ms=str(poll_ms),
        session_timeout_ms="6000",
    )
    from worker.app import Worker

    worker = Worker(settings)
    revocations: list[set[TopicPartition]] = []
    real_revoked = worker.on_revoked

    async def spy_revoked(partitions: set[TopicPartition], *, lost: bool = False) -> None:
        if partitions:  # the first join reports an empty revocation
            revocations.append(set(partitions))
        await real_revoked(partitions, lost=lost)

    worker.on_revoked = spy_revoked  # type: ignore[method-assign]
    async with running_worker(settings, worker):
        await send(kafka.bootstrap_servers, topics.input, requests)
        got = await collect(kafka.bootstrap_servers, topics, len(requests), timeout_s=60)
        assert revocations == [], "the member lost its partitions while the window was full"
    report(f"window full {delay_ms} ms > max_poll_interval_ms {poll_ms}", len(requests), got)
    assert len(got.results) == len(requests)
    assert got.duplicates == 0


async def test_dead_letter_write_failure_stops_the_worker_without_committing(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """A DLQ that refuses every write: the worker exits non-zero; the offset stays before it."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input, topics.output], partitions=1)
    # A real broker refusal: the DLQ topic only takes tiny messages.
    await kafka.create_topics([topics.dlq], partitions=1, configs={"max.message.bytes": "64"})
    good = samples.good_requests(5, seed=9, models=("double",))
    bad = samples.bad_requests()[0]
    await send(kafka.bootstrap_servers, topics.input, [*good, bad])
    proc = spawn_worker(
        worker_env(kafka, triton, topics, commit_interval_ms="100"), tmp_path / "worker.log"
    )
    try:
        code = await asyncio.to_thread(proc.wait, 120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 3
    committed = await kafka.committed_offsets(topics.group)
    assert committed.get(TopicPartition(topics.input, 0), 0) <= len(good)


async def test_result_refused_by_the_broker_becomes_output_too_large(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """The output topic refuses a result for its size: the request is dead-lettered."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input, topics.dlq], partitions=1)
    await kafka.create_topics([topics.output], partitions=1, configs={"max.message.bytes": "2000"})
    rng = np.random.default_rng(10)
    small = samples.SampleRequest(
        *samples.encode_request("double", samples.double_inputs(rng, 1, 2), "json", "small"),
        "double",
        "json",
        "small",
    )
    large = samples.SampleRequest(
        *samples.encode_request("double", samples.double_inputs(rng, 1, 1000), "json", "large"),
        "double",
        "json",
        "large",
    )
    async with running_worker(settings_for(kafka, triton, topics)):
        await send(kafka.bootstrap_servers, topics.input, [small, large])
        got = await collect(kafka.bootstrap_servers, topics, 2)
    assert "small" in got.results
    assert headers_dict(got.dead_letters["large"].headers)["x-error-code"] == b"OUTPUT_TOO_LARGE"


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
async def test_results_as_large_as_one_refused_are_dead_lettered_without_a_try(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, delivery: str
) -> None:
    """The output topic refused a result for its size: results as large or larger, soon after, are
    OUTPUT_TOO_LARGE without being sent (each refusal replaces a producer or aborts a
    transaction); a smaller result is still published."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input, topics.dlq], partitions=1)
    await kafka.create_topics([topics.output], partitions=1, configs={"max.message.bytes": "2000"})
    rng = np.random.default_rng(12)

    def request(rid: str, rows: int) -> samples.SampleRequest:
        value, headers = samples.encode_request(
            "double", samples.double_inputs(rng, 1, rows), "json", rid
        )
        return samples.SampleRequest(value, headers, "double", "json", rid)

    later = [request(f"large-{i}", 1100) for i in range(1, 4)]  # larger than large-0
    async with running_worker(settings_for(kafka, triton, topics, delivery=delivery)):
        await send(kafka.bootstrap_servers, topics.input, [request("large-0", 1000)])
        got = await collect(kafka.bootstrap_servers, topics, 1)
        await send(kafka.bootstrap_servers, topics.input, [*later, request("small", 2)])
        got = await collect(kafka.bootstrap_servers, topics, 5, into=got)
    assert "small" in got.results
    messages = {
        rid: headers_dict(got.dead_letters[rid].headers)
        for rid in ("large-0", *(r.request_id for r in later))
    }
    assert {h["x-error-code"] for h in messages.values()} == {b"OUTPUT_TOO_LARGE"}
    assert b"refused one of" not in messages["large-0"]["x-error-message"]
    for r in later:
        assert b"refused one of" in messages[r.request_id]["x-error-message"], r.request_id


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
async def test_a_result_refused_for_its_huge_key_leaves_ordinary_results_alone(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, delivery: str
) -> None:
    """A request whose key nearly fills the output topic's limit, amid ordinary requests:
    only its result is OUTPUT_TOO_LARGE; every ordinary one, before and after, is published
    (the broker judged key, value and headers, so no ceiling is learnt from its value)."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input, topics.dlq], partitions=1)
    # Under the producers' 16 KiB batches: the huge-keyed result shares a batch with its
    # neighbours, and the broker's refusal of that batch names them all (exactly_once then
    # sends them one by one: only the huge one is refused alone).
    limit = 4_000
    await kafka.create_topics(
        [topics.output], partitions=1, configs={"max.message.bytes": str(limit)}
    )
    rng = np.random.default_rng(14)

    def request(rid: str, width: int) -> samples.SampleRequest:
        value, headers = samples.encode_request(
            "double", samples.double_inputs(rng, 1, width), "json", rid
        )
        return samples.SampleRequest(value, headers, "double", "json", rid)

    # Its value is smaller than every ordinary one's: a ceiling learnt from the value
    # alone would refuse them all.
    huge = request("huge", 1)
    huge_key = b"k" * (limit - 100)
    before = [request(f"before-{i}", 8) for i in range(10)]
    after = [request(f"after-{i}", 8) for i in range(10)]
    around = [*before[:5], huge, *before[5:]]
    keys = [r.request_id.encode() if r is not huge else huge_key for r in around]
    async with running_worker(settings_for(kafka, triton, topics, delivery=delivery)):
        await send(kafka.bootstrap_servers, topics.input, around, keys=keys)
        got = await collect(kafka.bootstrap_servers, topics, len(around))
        # Sent once the refusal was seen: a ceiling it taught would meet every one.
        await send(kafka.bootstrap_servers, topics.input, after)
        got = await collect(kafka.bootstrap_servers, topics, len(around) + len(after), into=got)
    letters = {rid: headers_dict(r.headers) for rid, r in got.dead_letters.items()}
    assert {rid[:8]: h["x-error-code"] for rid, h in letters.items()} == {
        "kkkkkkkk": b"OUTPUT_TOO_LARGE"
    }, {rid[:12]: h["x-error-message"] for rid, h in letters.items()}
    assert set(got.results) == {r.request_id for r in (*before, *after)}


@pytest.mark.parametrize("ordering", ["key", "partition"])
async def test_ordering_holds_under_concurrency(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, ordering: str
) -> None:
    """key: per key, outputs follow input offsets; partition: per partition, they do too."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    rng = np.random.default_rng(11)
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all")
    await producer.start()
    try:
        for i in range(120):
            request = faulty_request(rng, f"o{i}", delay_ms=int(rng.integers(0, 40)))
            await producer.send(
                topics.input,
                request.value,
                key=f"k{i % 6}".encode(),
                headers=[*request.headers, ("x-request-id", f"o{i}".encode())],
            )
        await producer.flush()
    finally:
        await producer.stop()
    settings = settings_for(kafka, triton, topics, ordering=ordering, max_in_flight="64")
    async with running_worker(settings):
        got = await collect(kafka.bootstrap_servers, topics, 120)
    report(f"ordering={ordering} under concurrency", 120, got)
    order = await _output_order(kafka.bootstrap_servers, topics.output)
    group_of: Callable[[dict[str, bytes]], bytes] = (
        (lambda h: h["key"]) if ordering == "key" else (lambda h: h["x-source-partition"])
    )
    seen: dict[bytes, list[int]] = {}
    for headers in order:
        seen.setdefault(group_of(headers), []).append(int(headers["x-source-offset"]))
    assert len(got.results) == 120
    for group, offsets in seen.items():
        assert offsets == sorted(offsets), (group, offsets)


async def _output_order(bootstrap: str, topic: str) -> list[dict[str, bytes]]:
    """Headers (plus the key) of every output record, in the order they were written."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    out: list[dict[str, bytes]] = []
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        while await consumer.position(tp) < end:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for r in records:
                    out.append({**headers_dict(r.headers), "key": r.key or b""})
    finally:
        await consumer.stop()
    return out
