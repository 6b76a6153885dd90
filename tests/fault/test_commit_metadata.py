"""A group whose committed offsets carry metadata the worker did not write, exactly.

Anyone allowed to commit for the group can write an offset's metadata. Here a plain
consumer commits, before a worker process takes the partitions: runs far beyond
WORKER_MAX_UNCOMMITTED_PER_PARTITION (one of them longer than ``sys.maxsize``), the
worker's first format (which has no check), the worker's own metadata with a byte after
it, and another tool's metadata of 24 bytes without a terminator, which librdkafka's
binding reads past its end (its allocation is full: the byte after it is never 0). The
worker must process every record from those committed offsets as if there were no
metadata, say so once per partition, count it, and keep running; and skip the records
its own metadata lists, written as either client writes it.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from devtools import samples
from devtools.devstack.process import free_port
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    create,
    log_events,
    metric_sum,
    read_all,
    send,
    spawn_worker,
    wait_ready,
    worker_env,
)
from worker.delivery import metadata

pytestmark = pytest.mark.timeout(180)

PER_PARTITION = 20
#: The worker's own metadata, written as both clients write it (a C string's terminator).
OWN_POINT, OWN_DONE = 4, (6, 7, 9)
OWN = metadata.encode(OWN_POINT, OWN_DONE, 4096)
#: (committed offset, metadata) per partition, none of which the worker wrote exactly.
HOSTILE = {
    # A run past sys.maxsize, and one merely far past the bound (it would skip every record).
    0: (10, "d1:1+7fffffffffffffff"),
    1: (5, "d1:1+fffff"),
    # The first format as librdkafka read "d1:2+0" with one stray byte: it lists 7 and 8,
    # the worker had done 7 alone (read as written, it would skip 8, never done).
    2: (5, "d1:2+01\x00"),
    # The worker's own metadata with a byte after it.
    3: (5, f"{metadata.encode(5, [7], 4096)}0"),
    # 24 bytes without a terminator: librdkafka's binding reads on into its heap.
    4: (3, "another-tool:0123456789a"),
}
assert OWN is not None and len(HOSTILE[4][1]) == 24


async def _commit(bootstrap: str, topics: Topics, commits: dict[int, tuple[int, str]]) -> None:
    """Commit these offsets and metadata for the worker's group, as any group member could."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=topics.group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        parts = {TopicPartition(topics.input, p): meta for p, meta in commits.items()}
        consumer.assign(list(parts))
        await consumer.commit({tp: OffsetAndMetadata(*meta) for tp, meta in parts.items()})
    finally:
        await consumer.stop()


async def _all_done_or_exit(
    kafka: KafkaUnderTest, topics: Topics, partitions: int, proc: subprocess.Popen[bytes], log: Path
) -> None:
    """Wait until every partition is committed to its end (every record done or skipped);
    fail at once (with its log) if the worker exits first."""
    ends = {TopicPartition(topics.input, p): PER_PARTITION for p in range(partitions)}
    deadline = time.monotonic() + 90
    while await kafka.committed_offsets(topics.group) != ends:
        if proc.poll() is not None:
            tail = (await asyncio.to_thread(log.read_text))[-3000:]
            raise AssertionError(f"worker exited {proc.returncode}: {tail}")
        assert time.monotonic() < deadline, "not every partition committed to its end in 90 s"
        await asyncio.sleep(0.2)  # polling the group coordinator: nothing to await


async def test_hostile_commit_metadata_is_ignored_and_every_record_processed(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """Metadata the worker did not write exactly: processed from the offset, logged, no
    crash; its own (either client's way) skips what it lists."""
    topics = Topics.fresh(unique)
    own = len(HOSTILE)
    partitions = own + 1
    await create(kafka, topics, partitions=partitions)
    requests = samples.good_requests(partitions * PER_PARTITION, seed=91, models=("double",))
    by_partition = {p: requests[p::partitions] for p in range(partitions)}
    for partition, sent in by_partition.items():
        await send(kafka.bootstrap_servers, topics.input, sent, partition=partition)
    await _commit(kafka.bootstrap_servers, topics, {**HOSTILE, own: (OWN_POINT, f"{OWN}\x00")})
    wanted = {r.request_id for p, (offset, _) in HOSTILE.items() for r in by_partition[p][offset:]}
    wanted |= {
        r.request_id
        for offset, r in enumerate(by_partition[own])
        if offset >= OWN_POINT and offset not in OWN_DONE
    }

    port, log = free_port(), tmp_path / "worker.log"
    proc = spawn_worker(worker_env(kafka, triton, topics, metrics_port=str(port)), log)
    try:
        await _all_done_or_exit(kafka, topics, partitions, proc, log)
        await wait_ready(port, proc)
        ignored = await asyncio.to_thread(metric_sum, port, "worker_commit_metadata_ignored_total")
        skipped = await asyncio.to_thread(metric_sum, port, "worker_records_skipped_total")
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    got = await read_all(kafka.bootstrap_servers, topics)
    assert code == 0, log.read_text()[-3000:]
    assert set(got.results) == wanted and got.dead_letters == {}
    assert (ignored, skipped) == (len(HOSTILE), len(OWN_DONE))
    events = log_events(log, "commit_metadata_ignored")
    assert sorted(e["offset"] for e in events) == sorted(o for o, _ in HOSTILE.values())
