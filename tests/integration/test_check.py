"""``check`` against the real local stack: all good, then one thing wrong at a time."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from devtools.devstack.kafka import run_sync
from devtools.devstack.process import free_port
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    create,
    running_worker,
    settings_for,
    worker_env,
)
from tests.support.worker import clear_settings
from worker import cli
from worker.checks.report import CheckResult, run_checks

pytestmark = pytest.mark.timeout(120)


def _by_check(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {result.check: result for result in results}


def _failed(results: list[CheckResult]) -> dict[str, str]:
    return {r.check: r.detail for r in results if r.outcome == "fail"}


async def test_all_good(kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str) -> None:
    """Topics exist, the group is free, Triton serves the default and allow-listed models."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=3)
    settings = settings_for(
        kafka,
        triton,
        topics,
        default_model="double",
        model_allowlist=f"{topics.input}=mlp|echo_bytes|*",
    )

    results = await run_checks(settings)

    assert _failed(results) == {}
    by_check = _by_check(results)
    assert [r.check for r in results] == [
        "settings valid",
        "Kafka reachable",
        f"input topic {topics.input}",
        f"output topic {topics.output}",
        f"dead-letter topic {topics.dlq}",
        f"consumer group {topics.group}",
        "Triton ready",
        "model double",
        "model mlp",
        "model echo_bytes",
    ]
    assert by_check[f"input topic {topics.input}"].detail == "3 partitions, may read"
    assert by_check[f"dead-letter topic {topics.dlq}"].detail == "1 partitions, may write"
    assert "INPUT0 FP32" in by_check["model double"].detail


async def test_group_in_use_is_described_not_joined(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """With a worker running in the group, check reports its member and leaves it alone."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    settings = settings_for(kafka, triton, topics)
    from worker.app import Worker

    worker = Worker(settings)
    # librdkafka joins on its first poll, after start: wait for the assignment.
    assigned = asyncio.Event()
    real_assigned = worker.on_assigned

    async def spy_assigned(partitions: set[Any]) -> None:
        await real_assigned(partitions)
        if partitions:
            assigned.set()

    worker.on_assigned = spy_assigned  # type: ignore[method-assign]
    async with running_worker(settings, worker):
        await asyncio.wait_for(assigned.wait(), 30)
        results = await run_checks(settings)
    group = _by_check(results)[f"consumer group {topics.group}"]
    assert group.outcome == "ok"
    assert group.detail.startswith("Stable, 1 members")


async def test_missing_input_topic(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """An input topic that does not exist fails its row only, and is not created by the check."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    settings = settings_for(kafka, triton, topics, input_topics=f"{topics.input},absent-{unique}")

    results = await run_checks(settings)

    assert _failed(results) == {f"input topic absent-{unique}": "does not exist"}
    described = await kafka.describe_topics([f"absent-{unique}"])
    assert [t for t in described if t["error_code"] == 0] == []  # still unknown to the broker


async def test_missing_dlq_topic(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """A dead-letter topic that does not exist fails its row."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input, topics.output], partitions=1)

    results = await run_checks(settings_for(kafka, triton, topics))

    assert _failed(results) == {f"dead-letter topic {topics.dlq}": "does not exist"}


async def test_kafka_unreachable(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """No broker at the bootstrap address: Kafka fails, its dependent checks are skipped."""
    topics = Topics.fresh(unique)
    settings = settings_for(kafka, triton, topics, bootstrap_servers=f"127.0.0.1:{free_port()}")

    results = await run_checks(settings, timeout_s=5.0)

    assert list(_failed(results)) == ["Kafka reachable"]
    skipped = [r.check for r in results if r.outcome == "skip"]
    assert skipped == [
        f"input topic {topics.input}",
        f"output topic {topics.output}",
        f"dead-letter topic {topics.dlq}",
        f"consumer group {topics.group}",
    ]


async def test_wrong_triton_url(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Nothing listening at the Triton URL: Triton fails, the model checks are skipped."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    settings = settings_for(
        kafka, triton, topics, triton_url=f"127.0.0.1:{free_port()}", default_model="double"
    )

    results = await run_checks(settings, timeout_s=5.0)

    assert list(_failed(results)) == ["Triton ready"]
    assert _by_check(results)["model double"].outcome == "skip"


async def test_unknown_default_model(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """A default model Triton does not serve fails its row."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    settings = settings_for(kafka, triton, topics, default_model="no_such_model")

    results = await run_checks(settings)

    assert _failed(results) == {"model no_such_model": "not ready: Triton does not serve it"}


def _use_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    clear_settings(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_command_exit_codes(
    kafka: KafkaUnderTest,
    triton: TritonUnderTest,
    unique: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`python -m worker check`: 0 when all pass, 1 when one fails, 2 for invalid settings."""
    topics = Topics.fresh(unique)
    run_sync(lambda: create(kafka, topics))
    _use_env(monkeypatch, worker_env(kafka, triton, topics))

    assert cli.main(["check"]) == 0
    # Flags override the environment, exactly as for `run`.
    assert cli.main(["check", "--default-model", "no_such_model"]) == 1
    capsys.readouterr()
    assert cli.main(["check", "--max-in-flight", "abc"]) == 2
    error_lines = capsys.readouterr().err.splitlines()
    assert len(error_lines) == 1 and error_lines[0].startswith("error: --max-in-flight:")


def test_command_prints_the_table_alone_when_kafka_does_not_answer(
    kafka: KafkaUnderTest,
    triton: TritonUnderTest,
    unique: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Kafka not answering: the table says so; no log line of the retries on either stream."""
    topics = Topics.fresh(unique)
    env = worker_env(kafka, triton, topics, bootstrap_servers=f"127.0.0.1:{free_port()}")
    _use_env(monkeypatch, env)
    monkeypatch.setenv("COLUMNS", "400")  # one table row per line

    assert cli.main(["check"]) == 1

    out, err = capsys.readouterr()
    assert err == ""
    assert out.lstrip().startswith("worker check") and "not reachable within" in out
    assert "kafka_not_answering" not in out and "librdkafka" not in out
