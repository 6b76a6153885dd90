"""``replay`` against real Kafka and Triton: dead letters made by a real worker, sent back.

The dead letters of these tests come from a worker run: requests for ``double`` on a
topic whose ``WORKER_MODEL_ALLOWLIST`` does not allow it are FORBIDDEN, requests for
``faulty`` with FAIL=true are INFERENCE_ERROR. The command runs as its own process
(``python -m worker replay``) where its exit code and flags matter, and in-process
(`worker.replay.replay`) where the test reads its plan; both on the Kafka client under
test (``WORKER_TEST_KAFKA_CLIENT``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeAlias

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from devtools.samples import Encoding, SampleRequest, double_inputs, encode_request, faulty_request
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    request_id_of,
    result_outputs,
    running_worker,
    send,
    settings_for,
)
from tests.support.worker import command_argv, command_env, kafka_client_under_test
from worker.errors import ExitCode
from worker.replay import Filters, Outcome, Planner, ReplayPlan, render, replay
from worker.settings import KafkaAuthSettings, KafkaSettings
from worker.wire import header_value

pytestmark = pytest.mark.timeout(180)

Record: TypeAlias = ConsumerRecord[bytes, bytes]
#: The headers a worker adds to a dead letter; none may come back with a replay.
_WORKER_HEADERS = ("x-error-", "x-attempts", "x-source-", "x-consumer-group", "x-failed-at")


@dataclass
class _Double:
    """A request for ``double`` and the input it must come back doubled."""

    sample: SampleRequest
    values: np.ndarray[Any, Any]


def _doubles(prefix: str, count: int, seed: int) -> list[_Double]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        tensors = double_inputs(rng, width=4)
        encoding: Encoding = ("json", "binary", "protobuf")[i % 3]
        request_id = f"{prefix}-{i}"
        value, headers = encode_request("double", tensors, encoding, request_id)
        headers = [*headers, ("trace", f"t-{i}".encode())]
        sample = SampleRequest(value, headers, "double", encoding, request_id)
        out.append(_Double(sample, np.asarray(tensors[0].values)))
    return out


def _faulty(prefix: str, count: int) -> list[SampleRequest]:
    rng = np.random.default_rng(11)
    return [faulty_request(rng, f"{prefix}-{i}", fail=True) for i in range(count)]


async def _read(bootstrap: str, topic: str, count: int, start: int = 0) -> list[Record]:
    """Records of a one-partition ``topic`` from ``start`` until ``count`` have arrived."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level="read_committed"
    )
    await consumer.start()
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek(tp, start)
    records: list[Record] = []
    deadline = time.monotonic() + 60
    try:
        while len(records) < count:
            assert time.monotonic() < deadline, f"{topic}: {len(records)} of {count} records"
            batch = await consumer.getmany(tp, timeout_ms=500)
            records += batch.get(tp, [])
    finally:
        await consumer.stop()
    return records


async def _end(bootstrap: str, topic: str, partitions: int = 1) -> int:
    """Records written to ``topic`` so far (the sum of its partitions' end offsets)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        ends = await consumer.end_offsets([TopicPartition(topic, p) for p in range(partitions)])
        return sum(ends.values())
    finally:
        await consumer.stop()


@dataclass
class _Run:
    code: int
    stdout: str
    stderr: str


async def _cli(kafka: KafkaUnderTest, dlq_topic: str, *args: str) -> _Run:
    """``python -m worker replay`` as its own process, with the worker's WORKER_* settings."""
    env = command_env(
        {
            "WORKER_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
            "WORKER_DLQ_TOPIC": dlq_topic,
            "COLUMNS": "200",
        }
    )
    process = await asyncio.create_subprocess_exec(
        *command_argv("replay", *args),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 90)
    assert process.returncode is not None
    return _Run(process.returncode, stdout.decode(), stderr.decode())


_EVERYTHING = Filters()


async def _plan(
    kafka: KafkaUnderTest, dlq_topic: str, filters: Filters = _EVERYTHING, **kw: Any
) -> ReplayPlan:
    """The command's plan, in-process: a dry run unless told otherwise."""
    planner = Planner(filters, dlq_topic=dlq_topic, dry_run=kw.pop("dry_run", True), **kw)
    settings = KafkaSettings(
        bootstrap_servers=kafka.bootstrap_servers, kafka_client=kafka_client_under_test()
    )
    return await replay(planner, settings, KafkaAuthSettings())


def _ids(plan: ReplayPlan, outcome: Outcome = Outcome.SEND) -> set[str]:
    return {entry.letter.request_id for entry in plan.having(outcome)}


def _assert_replay_of(record: Record, letter: Record, count: int) -> None:
    """``record`` is ``letter``'s request as its producer sent it, plus the replay pair."""
    assert (record.value, record.key) == (letter.value, letter.key)
    names = [name for name, _ in record.headers]
    assert not [n for n in names if n.startswith(_WORKER_HEADERS)], names
    kept = [h for h in letter.headers if not h[0].startswith(_WORKER_HEADERS)]
    assert list(record.headers) == [
        *kept,
        ("x-replayed-from", f"{letter.topic}/{letter.partition}/{letter.offset}".encode()),
        ("x-replay-count", str(count).encode()),
    ]


async def _dead_letters(kafka: KafkaUnderTest, topics: Topics, count: int) -> dict[str, Record]:
    got = await collect(kafka.bootstrap_servers, topics, count)
    return got.dead_letters


async def test_dead_letters_replayed_after_the_fix_are_answered(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """FORBIDDEN under an allowlist without `double`; the allowlist fixed; the replay answered.

    The fix: the worker is restarted (same group) with `double` added to the input
    topic's WORKER_MODEL_ALLOWLIST. Only the FORBIDDEN dead letters are replayed
    (--code); the INFERENCE_ERROR ones, which the fix does not concern, stay.
    """
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    bootstrap = kafka.bootstrap_servers
    doubles = _doubles("d", 6, seed=1)
    faulty = _faulty("f", 2)
    forbidding = settings_for(kafka, triton, topics, model_allowlist=f"{topics.input}=faulty")
    async with running_worker(forbidding):
        await send(bootstrap, topics.input, [d.sample for d in doubles] + faulty)
        letters = await _dead_letters(kafka, topics, 8)
    codes = {rid: header_value(r.headers, "x-error-code") for rid, r in letters.items()}
    assert codes == {
        **{d.sample.request_id: b"FORBIDDEN" for d in doubles},
        **{s.request_id: b"INFERENCE_ERROR" for s in faulty},
    }
    requests_before = await _end(bootstrap, topics.input)

    fixed = settings_for(kafka, triton, topics, model_allowlist=f"{topics.input}=faulty|double")
    async with running_worker(fixed):
        run = await _cli(kafka, topics.dlq, "--code", "FORBIDDEN")
        assert run.code == ExitCode.OK, run.stderr
        # The command waited for every ack: the input topic holds exactly the replays.
        assert await _end(bootstrap, topics.input) == requests_before + 6
        results = await _read(bootstrap, topics.output, 6)

    replayed = await _read(bootstrap, topics.input, 6, start=requests_before)
    for record in replayed:
        _assert_replay_of(record, letters[request_id_of(record)], count=1)
    by_id = {request_id_of(r): r for r in results}
    assert set(by_id) == {d.sample.request_id for d in doubles}
    for d in doubles:
        result = by_id[d.sample.request_id]
        np.testing.assert_allclose(result_outputs(result)["OUTPUT0"], d.values * 2, rtol=1e-6)
        assert header_value(result.headers, "x-replay-count") == b"1"
        letter = letters[d.sample.request_id]
        assert header_value(result.headers, "x-replayed-from") == (
            f"{topics.dlq}/{letter.partition}/{letter.offset}".encode()
        )
    assert await _end(bootstrap, topics.dlq) == 8  # nothing failed again


async def test_filters_select_by_code_model_source_request_id_and_time(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Two source topics, two codes, two batches: each filter selects exactly what it names."""
    topics = Topics.fresh(unique)
    other = f"req2-{unique}"
    await create(kafka, topics)
    await kafka.create_topics([other, f"fixed-{unique}"], partitions=1)
    bootstrap = kafka.bootstrap_servers
    settings = settings_for(
        kafka,
        triton,
        topics,
        input_topics=f"{topics.input},{other}",
        model_allowlist=f"{topics.input}=faulty;{other}=mlp",
    )
    first, second = _doubles("one", 2, seed=2), _doubles("two", 2, seed=3)
    async with running_worker(settings):
        await send(bootstrap, topics.input, [first[0].sample, *_faulty("f", 1)])
        await send(bootstrap, other, [first[1].sample])
        await _dead_letters(kafka, topics, 3)
        between = datetime.now(UTC)
        await send(bootstrap, topics.input, [second[0].sample])
        await send(bootstrap, other, [second[1].sample])
        await _dead_letters(kafka, topics, 5)

    cases = {
        "code": (Filters(codes=frozenset({"INFERENCE_ERROR"})), {"f-0"}),
        "model": (Filters(models=frozenset({"double"})), {"one-0", "one-1", "two-0", "two-1"}),
        "source": (Filters(source_topics=frozenset({other})), {"one-1", "two-1"}),
        "id": (Filters(request_ids=frozenset({"one-0", "two-1"})), {"one-0", "two-1"}),
        "after": (Filters(failed_after=between), {"two-0", "two-1"}),
        "before": (Filters(failed_before=between), {"one-0", "one-1", "f-0"}),
        "all": (
            Filters(
                codes=frozenset({"FORBIDDEN"}),
                source_topics=frozenset({topics.input}),
                failed_after=between,
            ),
            {"two-0"},
        ),
    }
    for name, (filters, expected) in cases.items():
        plan = await _plan(kafka, topics.dlq, filters)
        assert plan.records == 5, name
        assert _ids(plan) == expected, name

    # The same filters as flags, sent for real to another topic.
    stamp = between.isoformat()
    run = await _cli(
        kafka,
        topics.dlq,
        "--source-topic",
        other,
        "--failed-after",
        stamp,
        "--to",
        f"fixed-{unique}",
    )
    assert run.code == ExitCode.OK, run.stderr
    assert await _end(bootstrap, f"fixed-{unique}") == 1
    (sent,) = await _read(bootstrap, f"fixed-{unique}", 1)
    assert request_id_of(sent) == "two-1"
    assert sent.value == second[1].sample.value
    assert header_value(sent.headers, "x-replay-count") == b"1"


async def test_dry_run_prints_the_plan_and_sends_nothing(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """--dry-run: counts by code and model, two samples of each; the source topic does not grow."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    bootstrap = kafka.bootstrap_servers
    settings = settings_for(kafka, triton, topics, model_allowlist=f"{topics.input}=faulty")
    async with running_worker(settings):
        await send(
            bootstrap, topics.input, [d.sample for d in _doubles("d", 7, 4)] + _faulty("f", 2)
        )
        await _dead_letters(kafka, topics, 9)
    before = await _end(bootstrap, topics.input)

    plan = await _plan(kafka, topics.dlq)
    assert plan.counts() == {
        ("FORBIDDEN", "double"): {Outcome.SEND: 7},
        ("INFERENCE_ERROR", "faulty"): {Outcome.SEND: 2},
    }
    summary, samples, *_ = render(plan)
    assert [column.header for column in summary.columns] == ["code", "model", "would send"]
    codes = next(list(column.cells) for column in samples.columns if column.header == "code")
    assert sorted(codes) == ["FORBIDDEN", "FORBIDDEN", "INFERENCE_ERROR", "INFERENCE_ERROR"]
    run = await _cli(kafka, topics.dlq, "--dry-run")
    assert run.code == ExitCode.OK, run.stderr
    assert "would send" in run.stdout
    assert await _end(bootstrap, topics.input) == before
    assert await _end(bootstrap, topics.dlq) == 9


async def test_replays_stop_at_the_limit(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """The cause not fixed: replayed 3 times, failed 3 times; the 4th replay is refused."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    bootstrap = kafka.bootstrap_servers
    settings = settings_for(kafka, triton, topics, model_allowlist=f"{topics.input}=faulty")
    async with running_worker(settings):
        await send(bootstrap, topics.input, [_doubles("d", 1, 5)[0].sample])
        (letter,) = await _read(bootstrap, topics.dlq, 1)
        for count in (1, 2, 3):
            plan = await _plan(kafka, topics.dlq, dry_run=False)
            # Only the newest dead letter stands for the request; earlier ones were replayed.
            assert len(plan.having(Outcome.SENT)) == 1
            assert len(plan.having(Outcome.REPLAYED_SINCE)) == count - 1
            (again,) = await _read(bootstrap, topics.dlq, 1, start=count)
            assert header_value(again.headers, "x-replay-count") == str(count).encode()
            assert header_value(again.headers, "x-error-code") == b"FORBIDDEN"
            assert again.value == letter.value
            letter = again
        before = await _end(bootstrap, topics.input)

        run = await _cli(kafka, topics.dlq)

        assert run.code == ExitCode.INCOMPLETE
        assert "replayed 3 times already (--max-replays 3)" in run.stdout
        assert await _end(bootstrap, topics.input) == before
        plan = await _plan(kafka, topics.dlq)
        (refused,) = plan.having(Outcome.OVER_LIMIT)
        assert refused.letter.offset == 3
        assert len(plan.having(Outcome.REPLAYED_SINCE)) == 3
        raised = await _plan(kafka, topics.dlq, max_replays=4)
        assert [e.letter.offset for e in raised.having(Outcome.SEND)] == [3]


async def test_transactional_dead_letters_are_read_to_the_snapshots_end(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Dead letters of an exactly_once worker sit between commit markers: all are sent once."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    await kafka.create_topics([f"fixed-{unique}"], partitions=1)
    bootstrap = kafka.bootstrap_servers
    settings = settings_for(
        kafka, triton, topics, model_allowlist=f"{topics.input}=faulty", delivery="exactly_once"
    )
    doubles = _doubles("d", 4, 6)
    async with running_worker(settings):
        # One at a time, each committed before the next is sent: several transactions.
        for count, d in enumerate(doubles, start=1):
            await send(bootstrap, topics.input, [d.sample])
            letters = await _read(bootstrap, topics.dlq, count)
    assert await _end(bootstrap, topics.dlq) > 4  # control records after the dead letters

    plan = await _plan(kafka, topics.dlq, dry_run=False, to_topic=f"fixed-{unique}")

    assert plan.records == 4
    assert len(plan.having(Outcome.SENT)) == 4
    sent = await _read(bootstrap, f"fixed-{unique}", 4)
    assert await _end(bootstrap, f"fixed-{unique}") == 4
    by_id = {request_id_of(letter): letter for letter in letters}
    for record in sent:
        _assert_replay_of(record, by_id[request_id_of(record)], count=1)


async def test_a_record_the_destination_refuses_fails_alone(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """--to a topic of 2 KiB records: tried again alone, the small one lands, the 3 KiB one fails.

    The two usually leave in one batch, which the broker refuses whole for the large
    record's size; either way the retry sends each record alone.
    """
    topics = Topics.fresh(unique)
    narrow = f"narrow-{unique}"
    await create(kafka, topics)
    await kafka.create_topics([narrow], partitions=1, configs={"max.message.bytes": "2048"})
    bootstrap = kafka.bootstrap_servers
    small = SampleRequest(b'{"inputs": [', [("x-request-id", b"small")], "-", "json", "small")
    large = SampleRequest(b"{" + b" " * 3072, [("x-request-id", b"large")], "-", "json", "large")
    async with running_worker(settings_for(kafka, triton, topics)):
        await send(bootstrap, topics.input, [large, small])
        letters = await _dead_letters(kafka, topics, 2)

    run = await _cli(kafka, topics.dlq, "--to", narrow)

    assert run.code == ExitCode.INCOMPLETE
    (landed,) = await _read(bootstrap, narrow, 1)
    _assert_replay_of(landed, letters["small"], count=1)
    assert await _end(bootstrap, narrow) == 1
    refused = f"{topics.dlq}/0/{letters['large'].offset}"
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("not sent 1:")]
    assert "MessageSizeTooLargeError" in line
    assert line.endswith(f": {refused}")


async def test_an_empty_dead_letter_topic(kafka: KafkaUnderTest, unique: str) -> None:
    """Nothing to replay: an empty plan and exit 0; a missing topic is an error, not created."""
    dlq = f"dlq-{unique}"
    await kafka.create_topics([dlq], partitions=3)

    plan = await _plan(kafka, dlq, dry_run=False)
    run = await _cli(kafka, dlq)
    missing = await _cli(kafka, f"absent-{unique}")

    assert (plan.records, plan.entries, plan.complete) == (0, [], True)
    assert run.code == ExitCode.OK, run.stderr
    assert missing.code == ExitCode.INCOMPLETE
    assert missing.stderr.strip() == f"error: dead-letter topic 'absent-{unique}' does not exist"
    described = await kafka.describe_topics([f"absent-{unique}"])
    assert [t for t in described if t["error_code"] == 0] == []


async def test_a_dead_letter_without_its_value_is_reported_with_its_source(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """A dead letter the DLQ kept without its value: replay names its source, sends the rest."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input, topics.output], partitions=1)
    await kafka.create_topics([topics.dlq], partitions=1, configs={"max.message.bytes": "2048"})
    bootstrap = kafka.bootstrap_servers
    small = SampleRequest(b'{"inputs": [', [("x-request-id", b"small")], "-", "json", "small")
    big = SampleRequest(b"{" + b" " * 4096, [("x-request-id", b"big")], "-", "json", "big")
    async with running_worker(settings_for(kafka, triton, topics)):
        await send(bootstrap, topics.input, [small, big])
        letters = await _dead_letters(kafka, topics, 2)
    without = letters["big"]
    assert header_value(without.headers, "x-value-omitted") == b"true"
    big_source = f"{topics.input}/0/{int(header_value(without.headers, 'x-source-offset') or -1)}"
    big_at = f"{topics.dlq}/0/{without.offset}"

    run = await _cli(kafka, topics.dlq)

    assert run.code == ExitCode.INCOMPLETE
    assert f"  {big_source} (dead letter {big_at})" in run.stdout.splitlines()
    (replayed,) = await _read(bootstrap, topics.input, 1, start=2)
    _assert_replay_of(replayed, letters["small"], count=1)
    assert await _end(bootstrap, topics.input) == 3
    plan = await _plan(kafka, topics.dlq)
    (omitted,) = plan.having(Outcome.VALUE_OMITTED)
    assert (omitted.letter.request_id, omitted.detail) == ("big", f"original at {big_source}")


async def test_connect_style_dead_letters_are_replayed_by_code(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """WORKER_DLQ_HEADER_STYLE=connect: dead letters carry Kafka Connect's headers, none of
    the worker's; replay reads the code and the source from them and sends the FORBIDDEN
    ones back without Connect's headers."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    bootstrap = kafka.bootstrap_servers
    doubles = _doubles("c", 3, seed=5)
    faulty = _faulty("cf", 1)
    forbidding = settings_for(
        kafka,
        triton,
        topics,
        model_allowlist=f"{topics.input}=faulty",
        dlq_header_style="connect",
    )
    async with running_worker(forbidding):
        await send(bootstrap, topics.input, [d.sample for d in doubles] + faulty)
        letters = await _dead_letters(kafka, topics, 4)
    for rid, letter in letters.items():
        names = [name for name, _ in letter.headers]
        assert not [n for n in names if n.startswith(_WORKER_HEADERS)], names
        headers = dict(letter.headers)
        expected = "Forbidden" if rid.startswith("c-") else "InferenceError"
        assert headers["__connect.errors.exception.class.name"] == (
            f"worker.errors.{expected}".encode()
        ), rid
        assert headers["__connect.errors.topic"] == topics.input.encode()
        assert headers["__connect.errors.connector.name"] == topics.group.encode()
    requests_before = await _end(bootstrap, topics.input)

    plan = await _plan(kafka, topics.dlq, Filters(codes=frozenset({"FORBIDDEN"})))
    assert _ids(plan) == {d.sample.request_id for d in doubles}
    run = await _cli(kafka, topics.dlq, "--code", "FORBIDDEN")
    assert run.code == ExitCode.OK, run.stderr

    replayed = await _read(bootstrap, topics.input, 3, start=requests_before)
    for record in replayed:
        letter = letters[request_id_of(record)]
        assert (record.value, record.key) == (letter.value, letter.key)
        assert [n for n, _ in record.headers if n.startswith("__connect.")] == []
        assert header_value(record.headers, "x-replayed-from") == (
            f"{topics.dlq}/{letter.partition}/{letter.offset}".encode()
        )
