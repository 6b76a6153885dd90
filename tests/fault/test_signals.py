"""Signals end a worker process: the first stops it, the second ends it within 2 s, at any moment.

Each test runs ``python -m worker run`` as a process and measures from the signal to
the process's exit. ``WORKER_TEST_KAFKA_CLIENT=confluent`` runs them on librdkafka.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from devtools import samples
from devtools.devstack.kafka import KafkaCluster
from devtools.devstack.process import free_port, tail
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    local_kafka,
    metric_sum,
    send,
    settings_for,
    silent_broker,
    spawn_worker,
    wait_logged,
    wait_ready,
    worker_env,
)
from worker.errors import ExitCode
from worker.kafka.rdkafka import config as rdkafka_config
from worker.kafka.rdkafka.publisher import RdProducer
from worker.shutdown import FORCED_EXIT_S

pytestmark = pytest.mark.timeout(240)


async def _exit_within(proc: subprocess.Popen[bytes], bound_s: float, log: Path) -> float:
    """Seconds until the process exits, measured now; fails past ``bound_s`` (+10 s to report)."""
    signalled = time.monotonic()
    try:
        await asyncio.to_thread(proc.wait, bound_s + 10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {bound_s + 10:.0f} s after the signal:\n{tail(log, 30)}")
    took_s = time.monotonic() - signalled
    print(f"\nexit {proc.returncode} {took_s:.2f} s after the last signal")
    assert took_s <= bound_s, f"exit {took_s:.2f} s after the signal (bound {bound_s} s)"
    return took_s


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("signals", [1, 2])
async def test_signals_during_start_up_end_it(
    triton: TritonUnderTest, unique: str, tmp_path: Path, signals: int
) -> None:
    """Ctrl-C (once, or twice) while the broker hangs the start-up: exit at once, no traceback."""
    log = tmp_path / "worker.log"
    with silent_broker() as broker:
        env = worker_env(
            type("Silent", (), {"bootstrap_servers": broker.address})(),
            triton,
            Topics.fresh(unique),
            metrics_port=str(free_port()),
        )
        proc = spawn_worker(env, log)
        try:
            # Connected: the worker is in its start-up (its signal handlers are in place).
            assert await asyncio.to_thread(broker.connected.wait, 60), tail(log, 30)
            proc.send_signal(signal.SIGINT)
            if signals == 2:
                await asyncio.sleep(0.2)  # a person's double Ctrl-C: two key presses apart
                proc.send_signal(signal.SIGINT)
            await _exit_within(proc, FORCED_EXIT_S, log)
        finally:
            _stop(proc)
    text = log.read_text()
    assert '"event":"startup_abandoned"' in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    # The first signal alone may end it before the second arrives; then it exits clean.
    forced = '"event":"forced_exit"' in text
    assert proc.returncode == (ExitCode.FORCED if forced else ExitCode.OK), text[-3000:]
    if signals == 1:
        assert proc.returncode == ExitCode.OK


async def _worker_holding_slow_records(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, log: Path, **extra: str
) -> tuple[subprocess.Popen[bytes], int]:
    """A worker whose window holds requests the ``faulty`` model answers after 4 s."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    port = free_port()
    env = worker_env(kafka, triton, topics, metrics_port=str(port), **extra)
    proc = spawn_worker(env, log)
    await wait_ready(port, proc)
    rng = np.random.default_rng(11)
    slow = [samples.faulty_request(rng, f"slow{i}", delay_ms=4000) for i in range(4)]
    await send(kafka.bootstrap_servers, topics.input, slow)
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(metric_sum, port, "worker_in_flight") < 1:
        assert time.monotonic() < deadline, "no request in flight in 60 s"
        await asyncio.sleep(0.05)  # polling another process's metrics: nothing to await
    return proc, port


async def test_second_signal_while_draining_ends_the_process(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """SIGTERM drains slow requests; a second SIGTERM ends the process within 2 s, exit 1."""
    log = tmp_path / "worker.log"
    proc, _ = await _worker_holding_slow_records(kafka, triton, unique, log)
    try:
        proc.send_signal(signal.SIGTERM)
        await wait_logged(proc, log, "shutdown_requested")
        proc.send_signal(signal.SIGTERM)
        await _exit_within(proc, FORCED_EXIT_S, log)
    finally:
        _stop(proc)
    assert proc.returncode == ExitCode.FORCED, tail(log, 30)


async def test_a_drain_that_times_out_exits_non_zero(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """One SIGTERM; the slow requests outlive WORKER_SHUTDOWN_TIMEOUT_S: exit 1, not 0."""
    log = tmp_path / "worker.log"
    proc, _ = await _worker_holding_slow_records(
        kafka, triton, unique, log, shutdown_timeout_s="0.5"
    )
    try:
        proc.send_signal(signal.SIGTERM)
        await _exit_within(proc, 20, log)
    finally:
        _stop(proc)
    text = log.read_text()
    assert '"event":"drain_timeout"' in text, text[-3000:]
    assert proc.returncode == ExitCode.FORCED, text[-3000:]


@pytest.fixture(scope="module")
def own_kafka() -> Iterator[KafkaCluster]:
    """A single-node broker for this module alone, so freezing it disturbs no other test."""
    with local_kafka(nodes=1) as cluster:
        yield cluster


@pytest.mark.parametrize("phase", ["final_commit", "client_close"])
async def test_second_signal_with_the_broker_frozen(
    own_kafka: KafkaCluster, triton: TritonUnderTest, unique: str, tmp_path: Path, phase: str
) -> None:
    """The broker freezes (SIGSTOP) mid-stream; SIGTERM; a second one in the final commit or
    in a client's close ends the process within 2 s, exit 1."""
    topics = Topics.fresh(unique)
    await create(own_kafka, topics, partitions=2)
    # 20 ms each on four model instances: the stream outlasts the test, so records are
    # always in flight (their results unacknowledged) when the broker freezes.
    rng = np.random.default_rng(65)
    requests = [samples.faulty_request(rng, f"f{i}", delay_ms=20) for i in range(2000)]
    await send(own_kafka.bootstrap_servers, topics.input, requests)
    port, log = free_port(), tmp_path / "worker.log"
    env = worker_env(own_kafka, triton, topics, metrics_port=str(port), shutdown_timeout_s="0.5")
    proc = spawn_worker(env, log)
    broker_pid = int(own_kafka.to_state()["nodes"][0]["pid"])
    try:
        await wait_ready(port, proc)
        await collect(own_kafka.bootstrap_servers, topics, 50)
        os.kill(broker_pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        # The drain times out (no result is acknowledged), then the final commit waits on
        # the frozen broker; CLOSE_TIMEOUT_S later a step is abandoned, and the clients'
        # closes (a flush, leaving the group) wait on it too.
        before = "drain_timeout" if phase == "final_commit" else "shutdown_step_abandoned"
        await wait_logged(proc, log, before)
        proc.send_signal(signal.SIGTERM)
        await _exit_within(proc, FORCED_EXIT_S, log)
    finally:
        os.kill(broker_pid, signal.SIGCONT)
        _stop(proc)
        # Thawed, the node takes a moment to lead its partitions again: the next test
        # must find it serving.
        await own_kafka.wait_for_leaders([topics.input])
    assert proc.returncode == ExitCode.FORCED, tail(log, 30)
    # Nothing raised on the way out, in any thread (the librdkafka producer's poll thread
    # outlived the loop and raised from call_soon_threadsafe; a SIGSEGV ends with no code).
    plain = [line for line in log.read_text().splitlines() if line and not line.startswith("{")]
    assert plain == [], tail(log, 30)


@pytest.mark.one_client  # librdkafka's producer, whichever client the workers run on
async def test_a_producer_left_open_by_a_forced_exit_never_calls_into_the_closed_loop(
    own_kafka: KafkaCluster, triton: TritonUnderTest, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop closes with the librdkafka producer neither flushed nor stopped and a record
    in flight to the frozen broker (a forced exit); thawed, the broker acknowledges it: its
    poll thread has ended, and nothing raised in any thread."""
    topics = Topics.fresh(unique)
    await create(own_kafka, topics)
    settings = settings_for(own_kafka, triton, topics)
    config = rdkafka_config.producer_config(
        settings.kafka, settings.kafka_auth, max_request_bytes=1 << 20
    )
    raised: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    broker_pid = int(own_kafka.to_state()["nodes"][0]["pid"])
    producer = RdProducer(config)

    async def forced_exit() -> asyncio.Future[object]:
        await producer.start()
        os.kill(broker_pid, signal.SIGSTOP)
        return await producer.send(topics.output, b"in flight", None, None)

    try:
        # A loop of its own, closed as the worker's is at a forced exit: the producer open.
        pending = await asyncio.to_thread(asyncio.run, forced_exit())
        assert not pending.done()
    finally:
        os.kill(broker_pid, signal.SIGCONT)
    poller = next(t for t in threading.enumerate() if t.name == "rdkafka-producer")
    await asyncio.to_thread(poller.join, 30)
    handle = producer.handle
    # The record's ack reached librdkafka (it was in flight, not lost): flushed here.
    assert await asyncio.to_thread(handle.flush, 30) == 0
    await asyncio.to_thread(handle.close)
    assert not poller.is_alive(), "the poll thread outlived the loop by 30 s"
    assert [f"{r.thread.name if r.thread else '?'}: {r.exc_value!r}" for r in raised] == []
    await own_kafka.wait_for_leaders([topics.input])
