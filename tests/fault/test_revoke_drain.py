"""Two members, one draining a revoke of slow records when the other joins.

The revoke waits (up to ``WORKER_REVOKE_TIMEOUT_S``) for the revoked partitions' records
in flight, then commits them and lets them go. On librdkafka the revoke callback runs
inside ``consume``, so nothing else calls the consumer meanwhile: these tests measure what
that costs the other member's rebalance, and what it does to a SIGTERM that comes then.
Each runs on the client WORKER_TEST_KAFKA_CLIENT names.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from devtools.devstack.process import free_port, tail
from devtools.samples import faulty_request
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
    wait_logged,
    wait_ready,
    worker_env,
)

pytestmark = pytest.mark.timeout(120)

#: The inference time of the slow record of each partition: both longer than a member's
#: start-up, so that the first member still has them in flight when the second joins; the
#: first done while the revoke still waits for the second.
_SLOW_MS = (6000, 9000)


@dataclass
class _Members:
    """The first member (draining its revoke when the second's join began it), the second."""

    first: subprocess.Popen[bytes]
    first_log: Path
    second: subprocess.Popen[bytes]
    second_log: Path
    topics: Topics


def _logged_at(log_path: Path, event: str) -> float:
    """When a worker process first logged ``event`` (epoch seconds, from its own log line)."""
    stamp = log_events(log_path, event)[0]["timestamp"]
    return datetime.fromisoformat(stamp).timestamp()


async def _in_flight(port: int, proc: subprocess.Popen[bytes], count: int) -> None:
    """Wait until a worker process has ``count`` records in flight."""
    await wait_ready(port, proc)
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(metric_sum, port, "worker_in_flight") < count:
        assert proc.poll() is None, f"worker exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"never {count} records in flight"
        await asyncio.sleep(0.1)  # polling another process's endpoint: nothing to await


@contextlib.asynccontextmanager
async def _second_joins(
    kafka: KafkaUnderTest,
    triton: TritonUnderTest,
    unique: str,
    tmp_path: Path,
    revoke_timeout_s: str,
) -> AsyncIterator[_Members]:
    """The first member with its slow records in flight; the second joins; yields once the
    first's revoke has begun. Both are stopped afterwards."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    rng = np.random.default_rng(23)
    for partition, delay_ms in enumerate(_SLOW_MS):
        slow = [faulty_request(rng, f"slow-{partition}", delay_ms=delay_ms)]
        await send(kafka.bootstrap_servers, topics.input, slow, partition=partition)
    port = free_port()
    env = worker_env(kafka, triton, topics, revoke_timeout_s=revoke_timeout_s)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(spawn_worker({**env, "WORKER_METRICS_PORT": str(port)}, tmp_path / "1.log"))
        await _in_flight(port, procs[0], len(_SLOW_MS))
        procs.append(spawn_worker(env, tmp_path / "2.log"))
        await wait_logged(procs[0], tmp_path / "1.log", "partitions_revoked")
        revoked = log_events(tmp_path / "1.log", "partitions_revoked")[0]
        assert revoked["in_flight"] == len(_SLOW_MS), f"the revoke found {revoked}"
        yield _Members(procs[0], tmp_path / "1.log", procs[1], tmp_path / "2.log", topics)
    finally:
        await _stop(procs)


async def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM, and wait: a member killed would leave its slow records running in Triton,
    holding the model's instances from the next test's."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_a_slow_revoke_holds_the_joining_members_partitions_for_its_bound_only(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """The first member's records take 6 and 9 s when a second joins: the second's partitions
    come once the first's revoke gave up after its 2 s bound, not later (on either client)."""
    bound_s = 2.0
    async with _second_joins(kafka, triton, unique, tmp_path, str(bound_s)) as members:
        await wait_logged(members.second, members.second_log, "partitions_assigned")
        waited_s = _logged_at(members.second_log, "partitions_assigned") - _logged_at(
            members.first_log, "partitions_revoked"
        )
    print(f"\nsecond member assigned {waited_s:.2f} s after the first's revoke began")
    # The rebalance waits for the drain (a clean hand-over), and for nothing more.
    assert bound_s - 0.1 <= waited_s < bound_s + 2.0, waited_s


async def test_sigterm_during_a_revoke_exits_once_its_records_are_done(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """SIGTERM while the revoke waits for 6 and 9 s records: exit 0 right after the last is
    published, no commit abandoned (on librdkafka the commit made when the first was done
    waited behind the revoke's consume, and the revoke for it: 5 s, the final commit's bound)."""
    async with _second_joins(kafka, triton, unique, tmp_path, "10") as members:
        members.first.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(members.first.wait, 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 60 s after SIGTERM:\n{tail(members.first_log, 30)}")
        exited = time.time()
        topics = members.topics
    got = await read_all(kafka.bootstrap_servers, topics)
    last_result_s = max(record.timestamp for record in got.results.values()) / 1000
    after_s = exited - last_result_s
    print(f"\nexit {code} {after_s:.2f} s after the last of its records was published")
    assert code == 0, tail(members.first_log, 30)
    assert len(got.results) == len(_SLOW_MS)
    assert log_events(members.first_log, "shutdown_step_abandoned") == []
    assert after_s < 2.0, f"exit {after_s:.1f} s after the drain"
