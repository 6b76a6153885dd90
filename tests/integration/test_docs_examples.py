"""The pages' examples run for real against the local Kafka and Triton.

Every JSON request shown on a page goes through a worker; where the page shows its
result, the worker's result is that one. The runbook's two ``replay`` commands run as
written (on the Kafka client under test), against a dead-letter topic holding a
FORBIDDEN dead letter: the dry run sends nothing, the second sends it back to its
source topic. (The quickstart runs in
test_quickstart.py; what is only parsed is said in tests/contract/test_docs_examples.py.)
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from devtools.docs import DOCS
from devtools.samples import SampleRequest
from tests.contract.examples import (
    blocks,
    documented_result,
    is_request,
    json_examples,
    read_script,
)
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
from tests.support.worker import command_argv, command_env

pytestmark = pytest.mark.timeout(180)


async def test_every_request_of_the_pages_gets_the_result_the_page_shows(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Each JSON request of a page is answered with a result (not a dead letter), and
    equal to the result its page shows, where it shows one."""
    examples = [(path, ex) for path, ex in json_examples() if is_request(ex)]
    assert {ex["model_name"] for _, ex in examples} >= {"double", "tokens"}
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    # Each id once: a request shown on two pages is sent once (ids are the collector's keys).
    by_id = {ex["id"]: (path, ex) for path, ex in examples}
    requests = [
        SampleRequest(json.dumps(ex).encode(), [], ex["model_name"], "json", rid)
        for rid, (_, ex) in by_id.items()
    ]
    async with running_worker(settings_for(kafka, triton, topics)):
        await send(kafka.bootstrap_servers, topics.input, requests)
        got = await collect(kafka.bootstrap_servers, topics, len(requests), timeout_s=90)
    assert got.dead_letters == {}
    shown = 0
    for rid, (path, _) in by_id.items():
        result = json.loads(got.results[rid].value)
        expected = documented_result(path, rid)
        if expected is not None:
            shown += 1
            assert result == expected, (path.name, rid)
    assert shown >= 2


def _replay_commands() -> list[list[str]]:
    (block,) = [b for p, b in blocks("sh") if p == DOCS / "runbook.md" and "replay" in b]
    return read_script(block).commands


async def test_the_runbooks_replay_commands_run_as_written(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """`replay --dry-run --code FORBIDDEN` lists a FORBIDDEN dead letter and sends nothing;
    `replay --code FORBIDDEN --failed-after 2h` sends it back; both exit 0."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    request = {
        "id": "forbidden-1",
        "model_name": "mlp",
        "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
    }
    settings = settings_for(kafka, triton, topics, model_allowlist=f"{topics.input}=double")
    async with running_worker(settings):
        await send(
            kafka.bootstrap_servers,
            topics.input,
            [SampleRequest(json.dumps(request).encode(), [], "mlp", "json", "forbidden-1")],
        )
        got = await collect(kafka.bootstrap_servers, topics, 1)
    assert list(got.dead_letters) == ["forbidden-1"]

    env = command_env(
        {"WORKER_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "WORKER_DLQ_TOPIC": topics.dlq}
    )
    dry_run, send_back = _replay_commands()
    assert dry_run[:3] == ["python", "-m", "worker"] and "--dry-run" in dry_run
    outputs = []
    for argv in (dry_run, send_back):
        done = await asyncio.to_thread(
            subprocess.run,
            command_argv(*argv[3:]),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        outputs.append(done.stdout)
    assert "FORBIDDEN" in outputs[0]
    records = await _read_topic(kafka.bootstrap_servers, topics.input)
    assert [r.key for r in records] == [b"forbidden-1", b"forbidden-1"]
    assert headers_dict(records[1].headers)["x-replay-count"] == b"1"


async def _read_topic(bootstrap: str, topic: str) -> list[Any]:
    """Every record of a one-partition topic, up to its end."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        part = TopicPartition(topic, 0)
        consumer.assign([part])
        await consumer.seek_to_beginning(part)
        end = (await consumer.end_offsets([part]))[part]
        records: list[Any] = []
        while len(records) < end:
            batch = await consumer.getmany(part, timeout_ms=1000)
            records += batch.get(part, [])
        return records
    finally:
        await consumer.stop()
