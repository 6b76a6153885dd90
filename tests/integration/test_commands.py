"""``topics``, ``produce`` and ``tail`` as a user runs them: the worker's settings, real Kafka.

Each command runs as ``python -m worker`` in a process of its own, configured by
``WORKER_*`` variables only (as after the README's quickstart ``export`` lines), on the
Kafka client under test (``WORKER_TEST_KAFKA_CLIENT``; on librdkafka aiokafka cannot
connect in the command's process); failures must end in one line on stderr and a
documented exit code.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections.abc import Mapping
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.partitioner import murmur2

from devtools.devstack.process import free_port
from tests.support import KafkaUnderTest, silent_broker
from tests.support.worker import command_argv, command_env
from worker.errors import ExitCode

pytestmark = pytest.mark.timeout(120)

REQUEST = {
    "id": "r1",
    "model_name": "double",
    "inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}],
}


def worker_command(
    env: Mapping[str, str], *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m worker ARGS`` with exactly these WORKER_* variables set (and the client
    under test, unless they name one)."""
    return subprocess.run(
        command_argv(*args),
        env=command_env(env),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def _one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


async def _records(bootstrap: str, topic: str, count: int) -> list[Any]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    found: list[Any] = []
    try:
        async with asyncio.timeout(30):
            while len(found) < count:
                batch = await consumer.getmany(timeout_ms=500)
                found += [r for records in batch.values() for r in records]
    finally:
        await consumer.stop()
    return found


async def test_produce_takes_kafka_and_the_topic_from_the_worker_settings(
    kafka: KafkaUnderTest, unique: str
) -> None:
    """WORKER_BOOTSTRAP_SERVERS and WORKER_INPUT_TOPICS alone: sent to the first input topic,
    keyed by the request's id, in the partition aiokafka and the Java client choose for it."""
    topic = f"produce-env-{unique}"
    await kafka.create_topics([topic], partitions=8)
    env = {"WORKER_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "WORKER_INPUT_TOPICS": topic}
    done = await asyncio.to_thread(
        worker_command, env, "produce", "--file", "-", stdin=json.dumps(REQUEST)
    )
    assert done.returncode == 0, done.stderr
    (record,) = await _records(kafka.bootstrap_servers, topic, 1)
    assert record.key == b"r1"
    assert json.loads(record.value) == REQUEST
    assert record.partition == (murmur2(b"r1") & 0x7FFFFFFF) % 8


async def test_topics_creates_the_missing_ones_and_leaves_the_others(
    kafka: KafkaUnderTest, unique: str
) -> None:
    """An existing input topic is kept as it is; output and dead-letter topics are created."""
    names = [f"in-{unique}", f"out-{unique}", f"dlq-{unique}"]
    await kafka.create_topics(names[:1], partitions=1)
    env = {
        "WORKER_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "WORKER_INPUT_TOPICS": names[0],
        "WORKER_OUTPUT_TOPIC": names[1],
        "WORKER_DLQ_TOPIC": names[2],
    }
    done = await asyncio.to_thread(worker_command, env, "topics", "--partitions", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "exists", names[0],
        "created", names[1], "(2", "partitions,", "1", "replicas)",
        "created", names[2], "(2", "partitions,", "1", "replicas)",
    ]  # fmt: skip
    described = {t["topic"]: len(t["partitions"]) for t in await kafka.describe_topics(names)}
    assert described == {names[0]: 1, names[1]: 2, names[2]: 2}
    again = await asyncio.to_thread(worker_command, env, "topics")
    assert again.returncode == 0, again.stderr
    assert [line.split()[0] for line in again.stdout.splitlines()] == ["exists"] * 3


async def test_tail_prints_the_last_records_with_their_headers(
    kafka: KafkaUnderTest, unique: str
) -> None:
    """The last N records as JSON lines, oldest first; --wait for more than exist: exit 4."""
    topic = f"tail-{unique}"
    await kafka.create_topics([topic])
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers)
    await producer.start()
    try:
        for i in range(3):
            value = json.dumps({"id": f"r{i}"}).encode()
            await producer.send_and_wait(topic, value, key=b"k", headers=[("x-n", str(i).encode())])
    finally:
        await producer.stop()
    env = {"WORKER_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "WORKER_DLQ_TOPIC": topic}
    done = await asyncio.to_thread(worker_command, env, "tail", "dead-letters", "-n", "2")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(line["value"]["id"], line["headers"]["x-n"]) for line in lines] == [
        ("r1", "1"),
        ("r2", "2"),
    ]
    short = await asyncio.to_thread(
        worker_command, env, "tail", "dead-letters", "-n", "5", "--wait", "0.5"
    )
    assert short.returncode == ExitCode.INCOMPLETE
    assert "3 of 5 records" in _one_error_line(short)
    assert len(short.stdout.splitlines()) == 3


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (("produce", "--file", "no-such.json", "--topic", "t"), ExitCode.CONFIG, "cannot read"),
        (("produce", "--file", "-"), ExitCode.CONFIG, "--topic: required"),
        (("produce", "--file", "-", "--topic", "missing"), ExitCode.CONFIG, "does not exist"),
        (("produce", "--file", "-", "--topic", "t", "--bootstrap-servers", "CLOSED"), 5, "unreach"),
        (("tail", "results", "--output-topic", "missing"), ExitCode.CONFIG, "does not exist"),
        (("topics", "--bootstrap-servers", "CLOSED"), ExitCode.UNAVAILABLE, "unreachable"),
        (("replay", "--bootstrap-servers", "CLOSED"), ExitCode.UNAVAILABLE, "unreachable"),
    ],
)
async def test_command_failures_end_in_one_line_and_a_documented_code(
    kafka: KafkaUnderTest, unique: str, args: tuple[str, ...], code: int, says: str
) -> None:
    """A missing file, topic or setting, an unreachable broker: one line, no traceback."""
    closed = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = {
        "WORKER_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "WORKER_OUTPUT_TOPIC": f"out-{unique}",
        "WORKER_DLQ_TOPIC": f"dlq-{unique}",
        "WORKER_INPUT_TOPICS": f"in-{unique}",
    }
    if args[0] == "produce" and "--topic" not in args:
        del env["WORKER_INPUT_TOPICS"]
    argv = [closed if word == "CLOSED" else word for word in args]
    done = await asyncio.to_thread(worker_command, env, *argv, stdin=json.dumps(REQUEST))
    assert done.returncode == code, done.stderr
    assert says in _one_error_line(done)
    assert "Traceback" not in done.stderr


def test_ctrl_c_ends_a_command_without_a_traceback(unique: str) -> None:
    """Ctrl-C while produce waits on a broker that never answers: exit 130, no traceback."""
    with silent_broker() as broker:
        proc = subprocess.Popen(
            command_argv("produce", "--file", "-", "--topic", unique),
            env=command_env({"WORKER_BOOTSTRAP_SERVERS": broker.address}),
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(REQUEST))
            proc.stdin.close()
            assert broker.connected.wait(60), "produce never contacted the broker"
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stderr is not None
            stderr = proc.stderr.read()
            proc.stderr.close()
    assert proc.returncode == ExitCode.INTERRUPTED, stderr
    assert "Traceback" not in stderr
