"""exactly_once when a transaction fails: the same member redoes its records at once.

Real Kafka and real Triton, on the client WORKER_TEST_KAFKA_CLIENT names. Requests
flow at a steady rate over three partitions while transactions fail: a result over
the output topic's ``max.message.bytes`` every two seconds, the only broker
restarted, or the leader of the output partition stopped. A watcher reads the
group's committed offsets from the broker and fails the test as soon as a partition
that has records to commit goes without progress for longer than its bound; a
``read_committed`` reader then reads both topics to their end, so a duplicate or a
loss would show.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.structs import TopicPartition

from devtools import samples
from devtools.devstack.kafka import KafkaCluster
from devtools.samples import SampleRequest, Tensor, encode_request
from tests.support import (
    Collected,
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    headers_dict,
    local_kafka,
    read_all,
    report,
    running_worker,
    settings_for,
)

pytestmark = pytest.mark.timeout(240)

COMMIT_INTERVAL_MS = 200
PARTITIONS = 3
#: The output topic refuses records over this size (the worker's own limit stays 1 MiB).
OUTPUT_MAX_BYTES = 30_000
#: Longest time a partition with records to commit may go without its committed offset
#: moving: a failed transaction is aborted and redone at the next commit, on a fresh
#: producer: 0.5-2.1 s measured on a two-core machine under other load, either client
#: (before, a partition stopped for good at its first record finished meanwhile).
STALL_BOUND_S = 25 * COMMIT_INTERVAL_MS / 1000
#: The same once a broker is back or a leader has moved: the clients reconnect and find
#: the partitions' leaders and the coordinators.
STALL_AFTER_FAULT_BOUND_S = 50 * COMMIT_INTERVAL_MS / 1000


def _wide(request_id: str, width: int) -> SampleRequest:
    """A binary ``faulty`` request of ``width`` floats: its result is about 4 * width bytes."""
    tensors = [
        Tensor("INPUT0", "FP32", (width,), np.arange(width, dtype=np.float32)),
        Tensor("FAIL", "BOOL", (1,), np.array([False], dtype=np.bool_)),
        Tensor("DELAY_MS", "INT32", (1,), np.array([0], dtype=np.int32)),
    ]
    value, headers = encode_request("faulty", tensors, "binary", request_id)
    return SampleRequest(value, headers, "faulty", "binary", request_id, "OUTPUT_TOO_LARGE")


@dataclass
class Progress:
    """Each input partition's committed offset (read from the broker) against its end."""

    topic: str
    ends: dict[int, int] = field(default_factory=lambda: dict.fromkeys(range(PARTITIONS), 0))
    committed: dict[int, int] = field(default_factory=lambda: dict.fromkeys(range(PARTITIONS), 0))
    moved_at: dict[int, float] = field(default_factory=dict)
    worst_stall_s: float = 0.0
    #: While set, stalls are not counted (the broker is down).
    paused: bool = False
    bound_s: float = STALL_BOUND_S

    def resume(self, bound_s: float) -> None:
        """Count stalls again, from now, against ``bound_s``."""
        now = time.monotonic()
        self.moved_at = dict.fromkeys(range(PARTITIONS), now)
        self.paused, self.bound_s = False, bound_s

    def caught_up(self) -> bool:
        return all(self.committed[p] >= self.ends[p] for p in range(PARTITIONS))

    def observe(self, offsets: dict[TopicPartition, int]) -> None:
        """One reading of the committed offsets; fails on a partition stalled too long."""
        now = time.monotonic()
        for p in range(PARTITIONS):
            offset = offsets.get(TopicPartition(self.topic, p), 0)
            if offset > self.committed[p] or self.committed[p] >= self.ends[p]:
                self.moved_at[p] = now
            self.committed[p] = max(self.committed[p], offset)
            if self.paused:
                continue
            stall_s = now - self.moved_at.setdefault(p, now)
            self.worst_stall_s = max(self.worst_stall_s, stall_s)
            assert stall_s <= self.bound_s, (
                f"partition {p}: committed offset {self.committed[p]} has not moved for "
                f"{stall_s:.1f} s (bound {self.bound_s:.1f} s) with records up to "
                f"{self.ends[p]} to commit; committed {self.committed}, ends {self.ends}"
            )


async def _watch(
    kafka: KafkaUnderTest, group: str, progress: Progress, flowing: asyncio.Event
) -> None:
    """Read the committed offsets until the flow has ended and every partition reached its end."""
    while flowing.is_set() or not progress.caught_up():
        try:
            offsets = await kafka.committed_offsets(group)
        except Exception:  # the broker is out of reach: nothing moved, as far as we know
            offsets = {}
        progress.observe(offsets)
        await asyncio.sleep(COMMIT_INTERVAL_MS / 1000)  # polling the broker: nothing to await


class Flow:
    """Requests sent at a steady rate, partition by partition in turn, each ack awaited."""

    def __init__(self, bootstrap: str, topic: str, progress: Progress) -> None:
        self._bootstrap = bootstrap
        self._topic = topic
        self._progress = progress
        self.sent: list[SampleRequest] = []

    async def run(
        self,
        requests: list[SampleRequest],
        rate_per_s: float,
        at: Callable[[int], None] = lambda _i: None,
    ) -> None:
        """Send ``requests`` at ``rate_per_s``; ``at(i)`` is called before the i-th one.

        Idempotent: a batch sent again after a leader moved is not appended twice, so every
        request is in the input once and a duplicate answer is the worker's.
        """
        producer = AIOKafkaProducer(
            bootstrap_servers=self._bootstrap, enable_idempotence=True, linger_ms=5
        )
        await producer.start()
        started = time.monotonic()
        try:
            acks = []
            for i, request in enumerate(requests):
                at(i)
                partition = i % PARTITIONS
                future = await producer.send(
                    self._topic, request.value, key=request.request_id.encode(),
                    headers=request.headers, partition=partition,
                )  # fmt: skip
                future.add_done_callback(self._acked)
                acks.append(future)
                self.sent.append(request)
                # Pacing the producer (not synchronisation).
                await asyncio.sleep(max(0.0, started + (i + 1) / rate_per_s - time.monotonic()))
            await asyncio.gather(*acks)
        finally:
            await producer.stop()

    def _acked(self, future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is None:
            meta = future.result()
            ends = self._progress.ends
            ends[meta.partition] = max(ends[meta.partition], meta.offset + 1)


@asynccontextmanager
async def _watched(kafka: KafkaUnderTest, topics: Topics) -> AsyncIterator[tuple[Progress, Flow]]:
    """A flow and a watcher of the group's progress; on leaving, waits for every partition
    to reach its end (the watcher fails the test on a stall first)."""
    progress = Progress(topics.input)
    progress.resume(STALL_BOUND_S)
    flowing = asyncio.Event()
    flowing.set()
    watcher = asyncio.create_task(_watch(kafka, topics.group, progress, flowing))
    try:
        yield progress, Flow(kafka.bootstrap_servers, topics.input, progress)
        flowing.clear()
        await watcher
    finally:
        watcher.cancel()


async def _warm_up(kafka: KafkaUnderTest, topics: Topics) -> Collected:
    """One request per partition answered: partitions assigned, transactions running."""
    warm = samples.good_requests(PARTITIONS, seed=70, models=("double",))
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all")
    await producer.start()
    try:
        for p, request in enumerate(warm):
            await producer.send_and_wait(
                topics.input, request.value, headers=request.headers, partition=p
            )
    finally:
        await producer.stop()
    return await collect(kafka.bootstrap_servers, topics, PARTITIONS, timeout_s=60)


def _check(sent: list[SampleRequest], everything: Collected, warm: Collected) -> None:
    """Each request answered once: a result, or its expected dead letter."""
    assert everything.duplicates == 0
    expected_results = {r.request_id for r in sent if r.expected_code is None}
    expected_dead = {r.request_id: r.expected_code for r in sent if r.expected_code}
    missing = expected_results - set(everything.results)
    assert not missing, f"{len(missing)} of {len(expected_results)} requests never answered"
    assert set(everything.results) == expected_results | set(warm.results)
    codes = {
        rid: headers_dict(record.headers)["x-error-code"].decode()
        for rid, record in everything.dead_letters.items()
    }
    assert codes == expected_dead


# -- results over the output topic's limit ---------------------------------------------


async def test_results_refused_for_size_amid_a_flow_leave_no_partition_stalled(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """exactly_once, 150 requests/s on 3 partitions, one result too large every 2 s: once each."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input], partitions=PARTITIONS)
    await kafka.create_topics(
        [topics.output], partitions=1, configs={"max.message.bytes": str(OUTPUT_MAX_BYTES)}
    )
    await kafka.create_topics([topics.dlq], partitions=1)
    rate_per_s, seconds = 150, 10
    requests = samples.good_requests(rate_per_s * seconds, seed=71, models=("double",))
    every = 2 * rate_per_s
    for n in range(seconds // 2):
        # ~40 KB results, one every 2 s, on each partition in turn.
        requests[every // 2 + n * every + n] = _wide(f"big-{n}", 10_000)
    assert len({i % PARTITIONS for i, r in enumerate(requests) if r.expected_code}) == PARTITIONS
    settings = settings_for(
        kafka, triton, topics, delivery="exactly_once", commit_interval_ms=str(COMMIT_INTERVAL_MS)
    )
    async with running_worker(settings):
        warm = await _warm_up(kafka, topics)
        started = time.monotonic()
        async with _watched(kafka, topics) as (progress, flow):
            await flow.run(requests, rate_per_s)
        elapsed_s = time.monotonic() - started
    everything = await read_all(kafka.bootstrap_servers, topics)
    report(
        "exactly_once, a result over the output topic's limit every 2 s amid 150/s",
        len(requests) + PARTITIONS,  # and the warm-up
        everything,
        progress.worst_stall_s,
    )
    print(f"worst stall {progress.worst_stall_s:.2f} s, all committed in {elapsed_s:.1f} s")
    _check(flow.sent, everything, warm)


# -- the only broker restarted ---------------------------------------------------------


@pytest.fixture
def own_kafka() -> Iterator[KafkaCluster]:
    """A single-node broker for this test alone, so restarting it disturbs no other test
    (stopped before the next one, which may start three nodes of its own)."""
    with local_kafka(nodes=1) as cluster:
        yield cluster


async def _flow_through(
    kafka: KafkaUnderTest,
    triton: TritonUnderTest,
    topics: Topics,
    fault: Callable[[], Awaitable[None]],
    seed: int,
) -> tuple[Progress, Flow, Collected]:
    """100 requests/s for 12 s on every partition; ``fault`` runs after 3 s while the flow
    goes on (stalls are not counted meanwhile), then the worker must commit everything."""
    rate_per_s, seconds = 100, 12
    requests = samples.good_requests(rate_per_s * seconds, seed=seed, models=("double",))
    settings = settings_for(
        kafka,
        triton,
        topics,
        delivery="exactly_once",
        commit_interval_ms=str(COMMIT_INTERVAL_MS),
        # The member outlives the fault: no rebalance hands its records over, the member
        # itself must redo what the failed transactions held.
        session_timeout_ms="45000",
    )
    async with running_worker(settings):
        warm = await _warm_up(kafka, topics)
        async with _watched(kafka, topics) as (progress, flow):
            midway = asyncio.Event()

            async def disturb() -> None:
                await midway.wait()
                progress.paused = True
                await fault()
                progress.resume(STALL_AFTER_FAULT_BOUND_S)

            disturbing = asyncio.create_task(disturb())
            # The flow goes on through the fault: its records wait in the producer.
            at = 3 * rate_per_s
            await flow.run(requests, rate_per_s, lambda i: midway.set() if i == at else None)
            await disturbing
    return progress, flow, warm


async def test_broker_restart_amid_a_flow_leaves_no_partition_stalled(
    own_kafka: KafkaCluster, triton: TritonUnderTest, unique: str
) -> None:
    """exactly_once, 100 requests/s on 3 partitions, the only broker restarted: once each."""
    topics = Topics.fresh(unique)
    await own_kafka.create_topics([topics.input], partitions=PARTITIONS)
    await own_kafka.create_topics([topics.output, topics.dlq], partitions=1)

    async def restart() -> None:
        await asyncio.to_thread(own_kafka.stop_node, 1)
        await asyncio.to_thread(own_kafka.start_node, 1)

    progress, flow, warm = await _flow_through(own_kafka, triton, topics, restart, seed=72)
    everything = await read_all(own_kafka.bootstrap_servers, topics)
    report(
        "exactly_once, the only broker restarted amid 100/s",
        len(flow.sent) + PARTITIONS,
        everything,
        progress.worst_stall_s,
    )
    _check(flow.sent, everything, warm)


async def test_leader_stopped_amid_a_flow_leaves_no_partition_stalled(
    cluster3: KafkaCluster, triton: TritonUnderTest, unique: str
) -> None:
    """exactly_once, 100 requests/s on 3 partitions, the output partition's leader stopped
    (3 nodes): leaders and coordinators on it move; once each."""
    topics = Topics.fresh(unique)
    await cluster3.create_topics([topics.input], partitions=PARTITIONS, replication=3)
    await cluster3.create_topics([topics.output, topics.dlq], partitions=1, replication=3)
    leader = await cluster3.leader(topics.output, 0)
    assert leader >= 0, f"{topics.output}: no leader named after 30 s"

    async def stop_leader() -> None:
        await asyncio.to_thread(cluster3.stop_node, leader)
        moved = await cluster3.leader(topics.output, 0)
        assert moved not in {leader, -1}, "the leader did not move"

    try:
        progress, flow, warm = await _flow_through(cluster3, triton, topics, stop_leader, seed=73)
    finally:
        await asyncio.to_thread(cluster3.start_node, leader)
    everything = await read_all(cluster3.bootstrap_servers, topics)
    report(
        "exactly_once, the output partition's leader stopped amid 100/s (3 nodes)",
        len(flow.sent) + PARTITIONS,
        everything,
        progress.worst_stall_s,
    )
    _check(flow.sent, everything, warm)
