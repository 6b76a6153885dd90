"""``python -m worker run`` as a real process: health endpoints, SIGTERM drain, bounded memory."""

from __future__ import annotations

import ast
import asyncio
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from devtools import samples
from devtools.devstack.paths import PROJECT_ROOT
from devtools.devstack.process import free_port
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    create,
    request_id_of,
    rss_bytes,
    spawn_worker,
    worker_env,
)
from tests.support.worker import env_without_settings

pytestmark = pytest.mark.timeout(240)


class Answers:
    """Counts results and dead letters as they arrive, on one long-lived consumer."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        self.ids: set[str] = set()
        self._consumer = AIOKafkaConsumer(
            topics.output,
            topics.dlq,
            bootstrap_servers=bootstrap,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )

    async def __aenter__(self) -> Answers:
        await self._consumer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._consumer.stop()

    async def until(self, count: int, proc: subprocess.Popen[bytes], log: Path) -> None:
        """Read until ``count`` distinct request ids are answered (fails if the worker dies)."""
        while len(self.ids) < count:
            if proc.poll() is not None:
                raise AssertionError(f"worker exited early, see its log at {log}")
            batch = await self._consumer.getmany(timeout_ms=500)
            for records in batch.values():
                self.ids.update(request_id_of(r) for r in records)


def _metric_sum(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def _get(port: int, path: str) -> tuple[int, dict[str, Any] | str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            body = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as exc:
        body, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(body)
    except json.JSONDecodeError:
        return status, body


async def _produce_fast(
    bootstrap: str, topic: str, requests: list[samples.SampleRequest], partitions: int
) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, linger_ms=20, acks=1, max_batch_size=512 * 1024
    )
    await producer.start()
    try:
        pending = []
        for i, r in enumerate(requests):
            pending.append(
                await producer.send(
                    topic,
                    r.value,
                    key=r.request_id.encode(),
                    headers=r.headers,
                    partition=i % partitions,
                )
            )
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


@pytest.fixture
async def answers(kafka: KafkaUnderTest, unique: str) -> AsyncIterator[tuple[Topics, Answers]]:
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=4)
    async with Answers(kafka.bootstrap_servers, topics) as got:
        yield topics, got


async def test_sigterm_drains_commits_and_exits_zero(
    kafka: KafkaUnderTest, triton: TritonUnderTest, answers: tuple[Topics, Answers], tmp_path: Path
) -> None:
    """SIGTERM mid-stream: exit 0; every offset below the commit point has its answer."""
    topics, got = answers
    port = free_port()
    requests = samples.good_requests(3000, seed=21)
    await _produce_fast(kafka.bootstrap_servers, topics.input, requests, partitions=4)
    log = tmp_path / "worker.log"
    proc = spawn_worker(
        worker_env(kafka, triton, topics, metrics_port=str(port), commit_interval_ms="60000"), log
    )
    try:
        await got.until(300, proc, log)
        status, body = _get(port, "/readyz")
        assert status == 200, body
        assert _get(port, "/healthz")[0] == 200
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()[-3000:]

    committed = await kafka.committed_offsets(topics.group)
    assert sum(committed.values()) >= 300  # the commit happened at shutdown, not on a timer
    wanted = await _ids_below(kafka.bootstrap_servers, topics.input, committed)
    missing = wanted - await _all_answers(kafka.bootstrap_servers, topics)
    assert not missing, f"{len(missing)} committed requests have no answer"


async def _ids_below(bootstrap: str, topic: str, committed: dict[TopicPartition, int]) -> set[str]:
    """Request ids of every input record below its partition's committed offset."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    ids: set[str] = set()
    try:
        parts = [tp for tp, off in committed.items() if off > 0]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        remaining = dict(committed)
        while any(remaining[tp] > 0 for tp in parts):
            batch = await consumer.getmany(timeout_ms=1000)
            for tp, records in batch.items():
                for r in records:
                    if r.offset < committed[tp]:
                        ids.add(request_id_of(r))
                        remaining[tp] = committed[tp] - r.offset - 1
    finally:
        await consumer.stop()
    return ids


async def _all_answers(bootstrap: str, topics: Topics) -> set[str]:
    async with Answers(bootstrap, topics) as got:
        consumer = got._consumer
        ends = await consumer.end_offsets(
            [TopicPartition(topics.output, 0), TopicPartition(topics.dlq, 0)]
        )
        while True:
            positions = {tp: await consumer.position(tp) for tp in ends}
            if all(positions[tp] >= end for tp, end in ends.items()):
                break
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                got.ids.update(request_id_of(r) for r in records)
        return got.ids


async def test_backlog_of_100k_keeps_memory_bounded(
    kafka: KafkaUnderTest, triton: TritonUnderTest, answers: tuple[Topics, Answers], tmp_path: Path
) -> None:
    """A 100,000-record backlog: fetched-not-done stays within the window, RSS stays flat."""
    topics, got = answers
    port = free_port()
    requests = samples.good_requests(100_000, seed=33, models=("double",))
    await _produce_fast(kafka.bootstrap_servers, topics.input, requests, partitions=4)
    log = tmp_path / "worker.log"
    env = worker_env(
        kafka, triton, topics, metrics_port=str(port), max_in_flight="128", max_poll_records="100"
    )
    proc = spawn_worker(env, log)
    bound = 128 + 4 * 100  # the window plus one fetch per partition
    try:
        await got.until(2_000, proc, log)
        rss_early = rss_bytes(proc.pid)
        samples_taken = []
        for target in (5_000, 8_000, 11_000):
            await got.until(target, proc, log)
            consumed = _metric_sum(port, "worker_records_consumed_total")
            finished = _metric_sum(port, "worker_results_published_total") + _metric_sum(
                port, "worker_dead_letters_total"
            )
            samples_taken.append(consumed - finished)
        rss_late = rss_bytes(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert max(samples_taken) <= bound, samples_taken
    growth_mb = (rss_late - rss_early) / 2**20
    assert growth_mb < 40, f"RSS grew {growth_mb:.1f} MiB while draining the backlog"


async def test_produce_command_sends_generated_and_bad_requests(
    kafka: KafkaUnderTest, answers: tuple[Topics, Answers]
) -> None:
    """`devtools produce --generate N --bad` puts N good requests plus every bad kind on a topic."""
    topics, _ = answers
    done = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "devtools",
            "produce",
            "--bootstrap-servers",
            kafka.bootstrap_servers,
            "--topic",
            topics.input,
            "--generate",
            "25",
            "--bad",
        ],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap_servers)
    await consumer.start()
    try:
        parts = [TopicPartition(topics.input, p) for p in range(4)]
        ends = await consumer.end_offsets(parts)
    finally:
        await consumer.stop()
    assert sum(ends.values()) == 25 + len(samples.bad_requests())


def test_demo_answers_every_request_and_exits_zero() -> None:
    """`python -m devtools demo` (`make demo`) answers all, shows a token stream, scored
    payment events, CloudEvents readings and an Avro payment read back by
    AvroDeserializer, stops all."""
    done = subprocess.run(
        [sys.executable, "-m", "devtools", "demo", "--requests", "90"],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
        env=env_without_settings() | {"COLUMNS": "120"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "unanswered" in done.stdout
    row = next(line for line in done.stdout.splitlines() if "unanswered" in line)
    assert row.split("│")[2].strip() == "0"
    # The decoupled token model's stream, joined into one result of 11 responses.
    assert "tokens (decoupled) stream: 11 responses joined into one result" in done.stdout
    # Plain payment events on a mapped topic (examples/payments.toml), scored by `mlp`.
    scored = [line for line in done.stdout.splitlines() if "payments event scored:" in line]
    assert len(scored) == 3, done.stdout[-3000:]
    event = json.loads(scored[0].split("scored: ", 1)[1])
    assert set(event) == {"payment_id", "amount", "fraud_score", "label"}
    assert (
        "payments event payment-20: INVALID_REQUEST $.features[7]: expected a number (FP32), "
        'got "n/a"' in done.stdout
    )
    # Sensor readings as CloudEvents (examples/readings.json), each answered in its mode.
    cloud = [line for line in done.stdout.splitlines() if "readings CloudEvent (" in line]
    assert len(cloud) == 2, done.stdout[-3000:]
    binary, structured = sorted(cloud)
    assert "(binary) answered: ce_specversion=1.0 ce_id=readings/0/" in binary, binary
    assert "ce_type=com.example.reading.doubled" in binary and "ce_correlationid=reading-" in binary
    data = json.loads("{" + binary.split(" {", 1)[1])
    assert data["doubled"] == {"OUTPUT0": [41.0, 0.5, 1.0]}, binary
    envelope = json.loads(structured.split("answered: ", 1)[1])
    assert envelope["type"] == "com.example.reading.doubled", structured
    assert envelope["id"].startswith("readings/0/") and envelope["correlationid"] == "reading-1"
    assert envelope["data"]["doubled"]["OUTPUT0"] == pytest.approx([43.0, 1.0, 1.2])
    # An Avro payment through the stack's Schema Registry, its result read back by
    # confluent-kafka's AvroDeserializer (examples/payments-avro.toml).
    (avro,) = [line for line in done.stdout.splitlines() if "payments-avro Avro event" in line]
    assert "scored, read back by AvroDeserializer (schema id " in avro, avro
    read = ast.literal_eval(avro.split("): ", 1)[1])
    assert set(read) == {"payment_id", "amount", "fraud_score", "label"}, avro
    assert read["payment_id"] == "avro-payment-0" and read["label"].startswith("class-")


async def test_worker_produce_sends_ndjson_from_stdin(kafka: KafkaUnderTest, unique: str) -> None:
    """`kafka-triton-worker produce --file -` sends each NDJSON request keyed by its id."""
    topic = f"produce-{unique}"
    await kafka.create_topics([topic])
    lines = "\n".join(
        json.dumps({"id": f"r{i}", "model_name": "double", "inputs": []}) for i in range(3)
    )
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "worker", "produce", "--bootstrap-servers",
         kafka.bootstrap_servers, "--topic", topic, "--file", "-"],
        input=lines,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        # As a user runs it: no WORKER_* of the test run's own (WORKER_TEST_KAFKA_CLIENT
        # is no setting, and the command refuses an unknown one).
        env=env_without_settings(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=kafka.bootstrap_servers, auto_offset_reset="earliest"
    )
    await consumer.start()
    records: list[Any] = []
    try:
        async with asyncio.timeout(30):
            while len(records) < 3:
                got = await consumer.getmany(timeout_ms=1000)
                records += [r for batch in got.values() for r in batch]
    finally:
        await consumer.stop()
    assert sorted(r.key for r in records) == [b"r0", b"r1", b"r2"]
    assert all(json.loads(r.value)["model_name"] == "double" for r in records)
    assert all(("content-type", b"application/json") in r.headers for r in records)
