"""exactly_once in a group of worker processes: hand-overs under load, a zombie member.

Real Kafka, real Triton, ``python -m worker run`` processes. Requests flow at a
steady rate while members join, leave or freeze; a ``read_committed`` reader then
reads both topics to their end, so a duplicate or a loss would show.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiokafka import AIOKafkaProducer

from devtools.devstack.process import free_port
from devtools.samples import SampleRequest, faulty_request
from tests.support import (
    Collected,
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    read_all,
    report,
    spawn_worker,
    wait_ready,
    worker_env,
)

pytestmark = pytest.mark.timeout(180)

#: Bound on a member's graceful stop: its shutdown drain (5 s) plus closing.
STOP_BOUND_S = 20.0


class Flow:
    """Requests produced at a steady rate, keyed by request id, until stopped."""

    def __init__(self, bootstrap: str, topic: str, make: Callable[[int], SampleRequest]) -> None:
        self._bootstrap = bootstrap
        self._topic = topic
        self._make = make
        self.sent: list[SampleRequest] = []
        self._stop = asyncio.Event()

    async def _run(self, rate_per_s: float) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=self._bootstrap, acks="all", linger_ms=5)
        await producer.start()
        try:
            acks = []
            while not self._stop.is_set():
                request = self._make(len(self.sent))
                acks.append(
                    await producer.send(
                        self._topic, request.value, key=request.request_id.encode(),
                        headers=request.headers,
                    )
                )  # fmt: skip
                self.sent.append(request)
                # Pacing the producer (not synchronisation): wake early when stopped.
                try:
                    await asyncio.wait_for(self._stop.wait(), 1 / rate_per_s)
                except TimeoutError:
                    pass
            await asyncio.gather(*acks)
        finally:
            await producer.stop()

    @asynccontextmanager
    async def running(self, rate_per_s: float) -> AsyncIterator[None]:
        """Produce while inside; on leaving, stop and wait for every ack."""
        task = asyncio.create_task(self._run(rate_per_s))
        try:
            yield
        finally:
            self._stop.set()
            await task


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
    except (urllib.error.URLError, OSError):
        return 0, ""


async def _metric(port: int, name: str) -> float:
    """The value of an unlabelled metric on a worker's /metrics (-1 if it does not answer)."""
    status, text = await asyncio.to_thread(_get, port, "/metrics")
    if status != 200:
        return -1.0
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


async def _ready(port: int) -> tuple[bool, dict[str, Any]]:
    status, text = await asyncio.to_thread(_get, port, "/readyz")
    try:
        detail = json.loads(text) if text else {}
    except json.JSONDecodeError:
        detail = {}
    return status == 200, detail


async def _until(what: str, check: Callable[[], Any], timeout_s: float) -> None:
    """Poll another process's state until ``check`` is true, or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.2)  # polling another process: nothing to await


def _events(log: Path) -> list[dict[str, Any]]:
    """The JSON log events of a member (other lines, such as a fatal one, left out)."""
    events = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            events.append(json.loads(line))
    return events


def _tail(log: Path) -> str:
    return log.read_text()[-3000:]


async def _stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    """SIGTERM a member; it must exit 0 within STOP_BOUND_S."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = await asyncio.to_thread(proc.wait, STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"no exit {STOP_BOUND_S} s after SIGTERM; see {log}") from None
    assert code == 0, f"exit {code} after SIGTERM:\n{_tail(log)}"


@asynccontextmanager
async def _members() -> AsyncIterator[list[subprocess.Popen[bytes]]]:
    """Worker processes started by the test; any still running at the end are killed."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()


def _check_exactly_once(sent: list[SampleRequest], everything: Collected) -> None:
    assert everything.duplicates == 0
    assert everything.dead_letters == {}
    missing = {r.request_id for r in sent} - set(everything.results)
    assert not missing, f"{len(missing)} requests never answered"
    assert len(everything.results) == len(sent)


async def test_exactly_once_hand_over_under_load_one_two_one(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """exactly_once, members 1 → 2 → 1 under load, drains timing out, both members with the
    same WORKER_CLIENT_ID (one set for quotas): each request once. (With the client id in
    librdkafka's transactional id, each member's start fenced the other's producer.)"""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=4)
    rng = np.random.default_rng(61)

    straggler_next = False

    def make(i: int) -> SampleRequest:
        # Every 8th request takes 1.5 s, longer than the 1 s revoke bound (at 16/s the
        # four model instances are busy about 80 % of the time). Whether one of them is in
        # flight with more than 1 s to go when a revocation comes is chance; the straggler
        # sent as the second member starts is not: it is still running when the first
        # member's partitions are revoked, so that drain times out.
        nonlocal straggler_next
        if straggler_next:
            straggler_next = False
            return faulty_request(rng, f"h{i}", delay_ms=10_000)
        return faulty_request(rng, f"h{i}", delay_ms=1500 if i % 8 == 0 else 20)

    settings = {
        "delivery": "exactly_once",
        "revoke_timeout_s": "1",
        "shutdown_timeout_s": "15",  # a stop waits for the straggler (10 s) too
        "max_in_flight": "16",
        "client_id": "shared-for-quotas",
    }
    ports = [free_port(), free_port()]
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    envs = [worker_env(kafka, triton, topics, metrics_port=str(port), **settings) for port in ports]
    got = Collected()
    flow = Flow(kafka.bootstrap_servers, topics.input, make)
    async with _members() as procs:
        async with flow.running(rate_per_s=16):
            procs.append(spawn_worker(envs[0], logs[0]))
            await wait_ready(ports[0], procs[0])
            got = await collect(kafka.bootstrap_servers, topics, 20, 60, into=got)
            # 1 → 2: the second member commits transactions of its own partitions.
            straggler_next = True
            procs.append(spawn_worker(envs[1], logs[1]))
            await wait_ready(ports[1], procs[1])

            async def second_commits() -> bool:
                return await _metric(ports[1], "worker_transactions_total") >= 1

            await _until("the second member commits", second_commits, 60)
            # 2 → 1: the second member leaves; the first takes everything back.
            await _stop(procs[1], logs[1])
            transactions = await _metric(ports[0], "worker_transactions_total")

            async def first_commits_again() -> bool:
                return await _metric(ports[0], "worker_transactions_total") >= transactions + 3

            await _until("the remaining member commits", first_commits_again, 60)
        got = await collect(kafka.bootstrap_servers, topics, len(flow.sent), 90, into=got)

        async def window_empty() -> bool:
            return await _metric(ports[0], "worker_in_flight") == 0

        # Every outcome is committed; the remaining member holds no slot for anything.
        await _until("the remaining member's window is empty", window_empty, 10)
        await _stop(procs[0], logs[0])
    everything = await read_all(kafka.bootstrap_servers, topics)
    report(
        "exactly_once, group 1 → 2 → 1 under load, revoke drains timing out",
        len(flow.sent),
        everything,
    )
    _check_exactly_once(flow.sent, everything)
    timeouts = [e for e in _events(logs[0]) if e["event"] == "revoke_drain_timeout"]
    assert timeouts, "no revocation drain timed out: the scenario did not happen"
    # Neither member's transactional producer was fenced by the other's.
    for log in logs:
        fenced = [e for e in _events(log) if "fenced by a newer instance" in str(e.get("error"))]
        assert fenced == [], f"{log.name}: {fenced[:2]}"


async def test_exactly_once_zombie_is_fenced_and_rejoins(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """exactly_once: a member frozen past its session timeout is fenced when it thaws; once."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=4)
    rng = np.random.default_rng(62)

    def make(i: int) -> SampleRequest:
        return faulty_request(rng, f"z{i}", delay_ms=30)

    settings = {"delivery": "exactly_once", "session_timeout_ms": "6000", "shutdown_timeout_s": "5"}
    ports = [free_port(), free_port()]
    logs = [tmp_path / "zombie.log", tmp_path / "other.log"]
    envs = [worker_env(kafka, triton, topics, metrics_port=str(port), **settings) for port in ports]
    got = Collected()
    flow = Flow(kafka.bootstrap_servers, topics.input, make)
    async with _members() as procs:
        async with flow.running(rate_per_s=30):
            procs += [spawn_worker(env, log) for env, log in zip(envs, logs, strict=True)]
            for port, proc in zip(ports, procs, strict=True):
                await wait_ready(port, proc)

            async def both_commit() -> bool:
                counts = [await _metric(port, "worker_transactions_total") for port in ports]
                shares = [await _metric(port, "worker_partitions_assigned") for port in ports]
                return min(counts) >= 1 and shares == [2, 2]

            await _until("both members commit on two partitions each", both_commit, 60)
            zombie = procs[0]
            zombie.send_signal(signal.SIGSTOP)
            frozen_at = time.monotonic()
            before = await kafka.committed_offsets(topics.group)

            async def other_took_over() -> bool:
                # The other member owns every partition, its producers started (ready),
                # and it has committed on each, the frozen member's included.
                if await _metric(ports[1], "worker_partitions_assigned") != 4:
                    return False
                if not (await _ready(ports[1]))[0]:
                    return False
                now = await kafka.committed_offsets(topics.group)
                return len(now) == 4 and all(now[tp] > before.get(tp, -1) for tp in now)

            await _until("the other member takes over", other_took_over, 60)
            takeover_s = time.monotonic() - frozen_at
            thawed_at = datetime.now(UTC)
            zombie.send_signal(signal.SIGCONT)

            async def zombie_back() -> bool:
                # Rejoined and committing again, or exited (then started again below).
                if zombie.poll() is not None:
                    return True
                return (
                    await _metric(ports[0], "worker_partitions_assigned") >= 1
                    and (await _ready(ports[0]))[0]
                )

            await _until("the thawed member rejoins or exits", zombie_back, 60)
            if zombie.poll() is not None:
                fatal = [line for line in _tail(logs[0]).splitlines() if line.startswith("fatal")]
                assert zombie.returncode != 0 and len(fatal) == 1, _tail(logs[0])
                # As an orchestrator would: start it again.
                logs[0] = tmp_path / "zombie-restarted.log"
                procs[0] = spawn_worker(envs[0], logs[0])
                await wait_ready(ports[0], procs[0])
            committed = len(got)
            got = await collect(kafka.bootstrap_servers, topics, committed + 30, 60, into=got)
        got = await collect(kafka.bootstrap_servers, topics, len(flow.sent), 90, into=got)
        for proc, log in zip(procs, logs, strict=True):
            await _stop(proc, log)
    everything = await read_all(kafka.bootstrap_servers, topics)
    report(
        "exactly_once, member frozen (SIGSTOP) past its session timeout, then thawed",
        len(flow.sent),
        everything,
        takeover_s,
    )
    _check_exactly_once(flow.sent, everything)
    # Thawed, the member learns it lost its partitions in one of two ways, whichever comes
    # first: its next transaction is refused (fenced), or its client reports the
    # partitions lost (librdkafka) before it writes. That it wrote nothing twice is
    # checked above. (Not a revocation: the stop at the end revokes too.)
    thawed = [
        e["event"]
        for e in _events(tmp_path / "zombie.log")
        if datetime.fromisoformat(e["timestamp"]) >= thawed_at
    ]
    gave_up = {"transactional_producer_fenced", "partitions_lost"}
    assert gave_up & set(thawed), f"the thawed member never learnt it was replaced: {thawed}"
