"""A group whose committed offsets carry metadata the worker could not have written.

Anyone allowed to commit for the group can write an offset's metadata. Here a plain
consumer commits runs far beyond WORKER_MAX_UNCOMMITTED_PER_PARTITION (one of them
longer than ``sys.maxsize``), then a worker process takes the partitions: it must
process every record from the committed offsets as if there were no metadata, say so
once per partition, count it, and keep running.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from devtools import samples
from devtools.devstack.process import free_port
from tests.support import (
    Collected,
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    log_events,
    metric_sum,
    send,
    spawn_worker,
    wait_ready,
    worker_env,
)

pytestmark = pytest.mark.timeout(180)

PER_PARTITION = 20
#: (committed offset, metadata) per partition: a run past sys.maxsize, and one that is
#: merely far past the bound (it would make the worker skip every later record).
HOSTILE = {0: (10, "d1:1+7fffffffffffffff"), 1: (5, "d1:1+fffff")}


async def _commit(bootstrap: str, topics: Topics) -> None:
    """Commit the hostile offsets for the worker's group, as any group member could."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=topics.group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        parts = {TopicPartition(topics.input, p): meta for p, meta in HOSTILE.items()}
        consumer.assign(list(parts))
        await consumer.commit({tp: OffsetAndMetadata(*meta) for tp, meta in parts.items()})
    finally:
        await consumer.stop()


async def _answers_or_exit(
    bootstrap: str, topics: Topics, expected: int, proc: subprocess.Popen[bytes], log: Path
) -> Collected:
    """Collect ``expected`` answers; fail at once (with its log) if the worker exits first."""
    answers = asyncio.ensure_future(collect(bootstrap, topics, expected, timeout_s=90))
    exited = asyncio.ensure_future(asyncio.to_thread(proc.wait))
    await asyncio.wait({answers, exited}, return_when=asyncio.FIRST_COMPLETED)
    if not answers.done():
        answers.cancel()
        tail = (await asyncio.to_thread(log.read_text))[-3000:]
        raise AssertionError(f"worker exited {proc.returncode}: {tail}")
    exited.cancel()  # the thread ends with the process
    return answers.result()


async def test_hostile_commit_metadata_is_ignored_and_every_record_processed(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """Runs past the bound in committed metadata: processed from the offset, logged, no crash."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    requests = samples.good_requests(2 * PER_PARTITION, seed=91, models=("double",))
    by_partition = {p: requests[p::2] for p in HOSTILE}
    for partition, sent in by_partition.items():
        await send(kafka.bootstrap_servers, topics.input, sent, partition=partition)
    await _commit(kafka.bootstrap_servers, topics)
    wanted = {r.request_id for p, sent in by_partition.items() for r in sent[HOSTILE[p][0] :]}

    port, log = free_port(), tmp_path / "worker.log"
    proc = spawn_worker(worker_env(kafka, triton, topics, metrics_port=str(port)), log)
    try:
        got = await _answers_or_exit(kafka.bootstrap_servers, topics, len(wanted), proc, log)
        await wait_ready(port, proc)
        ignored = await asyncio.to_thread(metric_sum, port, "worker_commit_metadata_ignored_total")
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()[-3000:]
    assert set(got.results) == wanted and got.dead_letters == {}
    assert ignored == len(HOSTILE)
    events = log_events(log, "commit_metadata_ignored")
    assert sorted(e["offset"] for e in events) == sorted(o for o, _ in HOSTILE.values())
    committed = await kafka.committed_offsets(topics.group)
    assert committed == {TopicPartition(topics.input, p): PER_PARTITION for p in HOSTILE}
