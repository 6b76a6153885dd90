"""Kafka restarts, leader failover and a group scaling 1 → 3 → 1: nothing lost."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools import samples
from devtools.devstack.kafka import KafkaCluster
from devtools.devstack.process import free_port, tail
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    collect_streams,
    create,
    local_kafka,
    report,
    running_worker,
    send,
    settings_for,
    spawn_worker,
    wait_ready,
    worker_env,
)
from tests.support.worker import kafka_client_under_test
from worker.app import Worker
from worker.flow.bounded import CLOSE_TIMEOUT_S
from worker.shutdown import FORCED_EXIT_S

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def own_kafka() -> Iterator[KafkaCluster]:
    """A single-node broker for this module alone, so restarting it disturbs no other test."""
    with local_kafka(nodes=1) as cluster:
        yield cluster


@contextlib.contextmanager
def _where_it_stands(worker: Worker) -> Iterator[None]:
    """An answer that does not come says where the worker stands: its records in flight by
    state, the oldest of them, each partition's commit point, its assignment, readiness."""
    try:
        yield
    except AssertionError as exc:
        assigned = sorted(map(str, worker.intake.assignment()))
        raise AssertionError(
            f"{exc}; in flight {worker.inflight.snapshot(5)}; assigned {assigned}; "
            f"readiness {worker.readiness()}"
        ) from None


async def test_single_broker_restart_mid_stream(
    own_kafka: KafkaCluster, triton: TritonUnderTest, unique: str
) -> None:
    """The only broker stops and starts again mid-stream: every request answered once or more."""
    topics = Topics.fresh(unique)
    await create(own_kafka, topics, partitions=2)
    requests = samples.good_requests(1500, seed=61, models=("double",))
    before, after = requests[:1000], requests[1000:]
    bootstrap = own_kafka.bootstrap_servers
    # The last third is written only once the broker is back, so the restart is mid-stream
    # however fast the worker answers. Throttled (a small window, no batching) so that it is
    # still answering the first two thirds as the broker stops.
    settings = settings_for(own_kafka, triton, topics, max_in_flight="4", batch_max_size="1")
    async with running_worker(settings) as worker:
        await send(bootstrap, topics.input, before)
        await collect(bootstrap, topics, 300)
        await asyncio.to_thread(own_kafka.stop_node, 1)
        await asyncio.to_thread(own_kafka.start_node, 1)
        back = time.monotonic()
        await send(bootstrap, topics.input, after)
        later = {r.request_id for r in after}
        with _where_it_stands(worker):
            await collect_streams(
                bootstrap, topics, later, 120, until=lambda s: not later.isdisjoint(s.results)
            )
            recovery_s = time.monotonic() - back
            got = await collect(bootstrap, topics, len(requests), 120)
    report("single broker restarted mid-stream", len(requests), got, recovery_s)
    assert got.dead_letters == {}
    assert set(got.results) == {r.request_id for r in requests}


async def test_partition_leader_failover(
    cluster3: KafkaCluster, triton: TritonUnderTest, unique: str
) -> None:
    """The leader of the input and output partitions stops mid-stream; the worker carries on."""
    topics = Topics.fresh(unique)
    await cluster3.create_topics(
        [topics.input, topics.output, topics.dlq], partitions=1, replication=3
    )
    requests = samples.good_requests(3000, seed=62, models=("double",))
    before, during, after = requests[:1000], requests[1000:2000], requests[2000:]
    leader = await cluster3.leader(topics.input, 0)
    bootstrap = cluster3.bootstrap_servers
    # The stream goes on while the leader stops (a controlled shutdown) and after it: the
    # last third is written only once it has stopped, so the failover is mid-stream however
    # fast the worker answers. Throttled (a small window, no batching) so that it is still
    # answering the first two thirds as the leader stops.
    settings = settings_for(cluster3, triton, topics, max_in_flight="4", batch_max_size="1")
    async with running_worker(settings):
        await send(bootstrap, topics.input, before)
        await collect(bootstrap, topics, 300)
        await asyncio.gather(
            asyncio.to_thread(cluster3.stop_node, leader), send(bootstrap, topics.input, during)
        )
        stopped = time.monotonic()
        await send(bootstrap, topics.input, after)
        later = {r.request_id for r in after}
        await collect_streams(
            bootstrap, topics, later, 120, until=lambda s: not later.isdisjoint(s.results)
        )
        recovery_s = time.monotonic() - stopped
        got = await collect(bootstrap, topics, len(requests), 120)
    report("partition leader failover (3 nodes)", len(requests), got, recovery_s)
    assert await cluster3.leader(topics.input, 0) not in {leader, -1}
    assert got.dead_letters == {}
    assert set(got.results) == {r.request_id for r in requests}
    await asyncio.to_thread(cluster3.start_node, leader)


@pytest.mark.parametrize("group_protocol", ["classic", "consumer"])
async def test_group_scales_one_three_one_mid_stream(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path, group_protocol: str
) -> None:
    """Workers join (1 → 3) and leave (3 → 1) mid-stream: all answered, duplicates bounded;
    under the classic (eager) protocol and the consumer one (KIP-848, incremental)."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=6)
    requests = samples.good_requests(6000, seed=63, models=("double",))
    await send(kafka.bootstrap_servers, topics.input, requests)
    # Throttled (small window, no batching) so the stream outlasts the workers' start-up.
    settings = {"max_in_flight": "8", "batch_max_size": "1", "commit_interval_ms": "200"}
    settings["group_protocol"] = group_protocol
    if group_protocol == "consumer":
        settings["kafka_client"] = "confluent"  # the only client that speaks it
    ports = [free_port() for _ in range(3)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(
            spawn_worker(
                worker_env(kafka, triton, topics, metrics_port=str(ports[0]), **settings),
                tmp_path / "w0.log",
            )
        )
        got = await collect(kafka.bootstrap_servers, topics, 500, 120)
        for i in (1, 2):
            env = worker_env(kafka, triton, topics, metrics_port=str(ports[i]), **settings)
            procs.append(spawn_worker(env, tmp_path / f"w{i}.log"))
        for port, proc in zip(ports[1:], procs[1:], strict=True):
            await wait_ready(port, proc)
        got = await collect(kafka.bootstrap_servers, topics, len(got) + 1, 120, into=got)
        assert len(got) < len(requests), "the stream ended before the group grew"
        for proc in procs[1:]:
            proc.send_signal(signal.SIGTERM)
        for proc in procs[1:]:
            assert await asyncio.to_thread(proc.wait, 60) == 0
        got = await collect(kafka.bootstrap_servers, topics, len(requests), 120, into=got)
        procs[0].send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(procs[0].wait, 60) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert got.dead_letters == {}
    assert set(got.results) == {r.request_id for r in requests}
    # Graceful hand-overs drain and commit: at most the records finished between a
    # commit and a revocation may be redone.
    report(f"group scaled 1 → 3 → 1 mid-stream ({group_protocol})", len(requests), got)
    assert got.duplicates <= 3 * 64


@pytest.mark.parametrize("signals", [1, 2])
async def test_sigterm_while_the_broker_is_down_ends_the_worker(
    own_kafka: KafkaCluster, triton: TritonUnderTest, unique: str, tmp_path: Path, signals: int
) -> None:
    """SIGTERM while the only broker is down: exit 0 within its bounds; a second one: exit 1 now."""
    topics = Topics.fresh(unique)
    await create(own_kafka, topics, partitions=2)
    await send(own_kafka.bootstrap_servers, topics.input, samples.good_requests(3000, seed=64))
    port = free_port()
    env = worker_env(
        own_kafka,
        triton,
        topics,
        metrics_port=str(port),
        shutdown_timeout_s="3",
        max_in_flight="32",
        batch_max_size="1",
    )
    proc = spawn_worker(env, tmp_path / "worker.log")
    try:
        await wait_ready(port, proc)
        await collect(own_kafka.bootstrap_servers, topics, 100)
        await asyncio.to_thread(own_kafka.stop_node, 1)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        if signals == 2:
            # Once the first signal's drain waits on the broker, the second one ends it.
            log = tmp_path / "worker.log"
            deadline = time.monotonic() + 30
            while b'"shutdown_requested"' not in log.read_bytes():
                assert time.monotonic() < deadline, "the first SIGTERM was not handled"
                await asyncio.sleep(0.05)  # polling another process's log: nothing to await
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
        # The drain (3 s), then the final commit, the producer and the consumer close,
        # each bounded by CLOSE_TIMEOUT_S; after a second signal, FORCED_EXIT_S in all.
        bound_s = 3 + 3 * CLOSE_TIMEOUT_S if signals == 1 else FORCED_EXIT_S
        try:
            code = await asyncio.to_thread(proc.wait, bound_s + 10)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"worker still running {bound_s + 10:.0f} s after SIGTERM x{signals} with the "
                f"broker down:\n{tail(tmp_path / 'worker.log', 30)}"
            )
        took_s = time.monotonic() - signalled
        print(f"\nexit {code} {took_s:.2f} s after SIGTERM x{signals}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await asyncio.to_thread(own_kafka.start_node, 1)
    # Records still in flight when the drain's 3 s ran out were abandoned: exit 1 too.
    drained = b'"drain_timeout"' not in (tmp_path / "worker.log").read_bytes()
    assert code == (0 if signals == 1 and drained else 1), tail(tmp_path / "worker.log", 30)
    # One signal: the process's own exit after the bounded steps may take a moment more
    # (librdkafka destroying its handles with the broker down).
    slack_s = (3 + (2 if kafka_client_under_test() == "confluent" else 0)) if signals == 1 else 0
    assert took_s <= bound_s + slack_s, f"exit {took_s:.1f} s after the signal (bound {bound_s} s)"
