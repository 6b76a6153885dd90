"""Running the worker in tests: settings, in-process and as a process, readiness, reports."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from tests.support.kafka import Collected, Topics
from worker.app import Worker
from worker.settings import Settings, load_settings

#: A commit is sent WORKER_COMMIT_INTERVAL_MS after the previous one returned, and holds
#: the offsets done when it was sent: records finished during its round trip (and the
#: event loop's lag on a loaded machine) count as "since the last commit" too. Bounds on
#: what a SIGKILL makes the next owner redo add this to the interval.
COMMIT_SLACK_MS = 100


def worker_env(kafka: Any, triton: Any, topics: Topics, **extra: str) -> dict[str, str]:
    """WORKER_* settings for a worker on these topics (extra: SETTING_NAME=value)."""
    env = {
        "WORKER_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "WORKER_INPUT_TOPICS": topics.input,
        "WORKER_OUTPUT_TOPIC": topics.output,
        "WORKER_DLQ_TOPIC": topics.dlq,
        "WORKER_GROUP_ID": topics.group,
        "WORKER_TRITON_URL": triton.grpc_address,
        "WORKER_METRICS_PORT": "0",
        "WORKER_COMMIT_INTERVAL_MS": "200",
        "WORKER_LOG_FORMAT": "json",
    }
    # The whole suite runs against either client: WORKER_TEST_KAFKA_CLIENT=confluent.
    env["WORKER_KAFKA_CLIENT"] = kafka_client_under_test()
    env.update({f"WORKER_{k.upper()}": v for k, v in extra.items()})
    return env


def kafka_client_under_test() -> str:
    """The Kafka client the tests run the worker with (WORKER_TEST_KAFKA_CLIENT, aiokafka)."""
    return os.environ.get("WORKER_TEST_KAFKA_CLIENT", "aiokafka")


def settings_for(kafka: Any, triton: Any, topics: Topics, **extra: str) -> Settings:
    return load_settings(worker_env(kafka, triton, topics, **extra))


@contextlib.asynccontextmanager
async def running_worker(settings: Settings, worker: Worker | None = None) -> AsyncIterator[Worker]:
    """A worker running in this event loop; stopped gracefully (and checked) on exit."""
    worker = worker or Worker(settings)
    task = asyncio.create_task(worker.run())
    started = asyncio.create_task(worker.started.wait())
    done, _ = await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        started.cancel()
        task.result()  # start-up failed: raise its error here
    try:
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)


def spawn_worker(env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """``python -m worker run`` as a separate process, its log in ``log_path``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    full_env.update(env)
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "worker", "run"],
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _answers_ready(port: int) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


async def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """Wait until a worker process answers ``/readyz`` with 200 (fails if it exits first)."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(_answers_ready, port):
        assert proc.poll() is None, f"worker exited with {proc.returncode} before it was ready"
        assert time.monotonic() < deadline, f"worker on port {port} not ready in {timeout_s} s"
        await asyncio.sleep(0.1)  # polling another process's endpoint: nothing to await


async def wait_for_event(
    log_path: Path, event: str, proc: subprocess.Popen[bytes], timeout_s: float = 60
) -> None:
    """Wait until a worker process's JSON log has a line of ``event`` (fails if it exits)."""
    needle = f'"event":"{event}"'.encode()
    deadline = time.monotonic() + timeout_s
    while needle not in await asyncio.to_thread(log_path.read_bytes):
        assert proc.poll() is None, f"worker exited with {proc.returncode} before {event}"
        assert time.monotonic() < deadline, f"no {event} in the worker's log in {timeout_s} s"
        await asyncio.sleep(0.02)  # polling another process's log: nothing to await


def metric_value(port: int, name: str) -> float:
    """The sum of a metric's samples on a worker process's ``/metrics`` (0 when absent)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def results_published(worker: Worker, model: str = "double") -> float:
    """Results of ``model`` the broker has acknowledged so far, read from the worker's metrics
    (a fault test asserts with it that its fault came while requests were still unanswered)."""
    return float(worker.metrics.results_published_total.labels(model=model)._value.get())


def report(scenario: str, sent: int, got: Collected, recovery_s: float | None = None) -> None:
    """Print one line of the README's reliability table (visible with ``pytest -s``)."""
    answered = len(got)
    recovery = f"{recovery_s:.1f} s" if recovery_s is not None else "-"
    print(
        f"\nRELIABILITY | {scenario} | {sent} | {sent - answered} | {got.duplicates} | "
        f"{len(got.dead_letters)} | {recovery} |"
    )
