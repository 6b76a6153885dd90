"""Running the worker in tests: settings, in-process and as a process, readiness, reports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast, get_args

import pytest

from tests.support.kafka import Collected, Topics
from tests.support.servers import KafkaUnderTest, TritonAddress
from worker.app import Worker
from worker.settings import Settings, load_settings
from worker.settings.fields import KafkaClient

#: A commit is sent WORKER_COMMIT_INTERVAL_MS after the previous one returned, and holds
#: the offsets done when it was sent: records finished during its round trip (and the
#: event loop's lag on a loaded machine) count as "since the last commit" too. Bounds on
#: what a SIGKILL makes the next owner redo add this to the interval.
COMMIT_SLACK_MS = 100


def env_without_settings() -> dict[str, str]:
    """This process's environment without its WORKER_* variables: a process a test runs
    gets the settings the test gives it, none of the run's (the run's own, such as
    WORKER_TEST_KAFKA_CLIENT, would be an unknown setting to the commands)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}


def clear_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every WORKER_* variable from this process's environment, for the test."""
    for name in [n for n in os.environ if n.startswith("WORKER_")]:
        monkeypatch.delenv(name)


def worker_env(
    kafka: KafkaUnderTest, triton: TritonAddress, topics: Topics, **extra: str
) -> dict[str, str]:
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


def kafka_client_under_test() -> KafkaClient:
    """The Kafka client the tests run the worker with (WORKER_TEST_KAFKA_CLIENT, aiokafka)."""
    client = os.environ.get("WORKER_TEST_KAFKA_CLIENT", "aiokafka")
    assert client in get_args(KafkaClient), f"WORKER_TEST_KAFKA_CLIENT={client!r}"
    return cast(KafkaClient, client)


#: Runs ``python -m worker`` with every aiokafka connection refused: a command run on
#: librdkafka that still reached Kafka through aiokafka would fail its test. Not a fake:
#: nothing is answered in aiokafka's place.
_WITHOUT_AIOKAFKA = """
import runpy

import aiokafka.conn

async def refused(*args, **kwargs):
    raise AssertionError("aiokafka connected under WORKER_KAFKA_CLIENT=confluent")

aiokafka.conn.AIOKafkaConnection.connect = refused
runpy.run_module("worker", run_name="__main__", alter_sys=True)
"""


def command_argv(*args: str) -> list[str]:
    """``python -m worker ARGS`` for a command run on the client under test (see
    ``command_env``): on librdkafka, in a process where aiokafka cannot connect."""
    if kafka_client_under_test() == "confluent":
        return [sys.executable, "-c", _WITHOUT_AIOKAFKA, *args]
    return [sys.executable, "-m", "worker", *args]


def command_env(settings: Mapping[str, str]) -> dict[str, str]:
    """The environment of a command run by a test: none of the run's WORKER_* variables,
    the client under test (WORKER_KAFKA_CLIENT), then ``settings``."""
    return {
        **env_without_settings(),
        "WORKER_KAFKA_CLIENT": kafka_client_under_test(),
        **settings,
    }


def settings_for(
    kafka: KafkaUnderTest, triton: TritonAddress, topics: Topics, **extra: str
) -> Settings:
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
    full_env = env_without_settings()
    full_env.update(env)
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "worker", "run"],
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


@dataclass(frozen=True)
class Exited:
    """A worker process run to its end: its exit code, the seconds it took, its output."""

    code: int
    seconds: float
    lines: list[str]

    def events(self) -> list[str]:
        """The events of its JSON log lines."""
        return [json.loads(line)["event"] for line in self.lines if _is_json_object(line)]

    def error_line(self, max_lines: int = 30) -> str:
        """The one line it ended with, once it is checked that every other line is one of
        its JSON log lines: no traceback, no raw librdkafka line, no unclosed-client
        warning, and no more than ``max_lines`` lines in all."""
        text = "\n".join(self.lines)
        plain = [line for line in self.lines if not _is_json_object(line)]
        assert len(plain) == 1 and plain[0].startswith("error: "), text[-3000:]
        for noise in ("Traceback", "Unclosed", "%3|", "%4|", "%6|"):
            assert noise not in text, f"{noise!r} in the output:\n{text[-3000:]}"
        assert len(self.lines) <= max_lines, f"{len(self.lines)} lines:\n{text[-3000:]}"
        return plain[0]


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def run_to_exit(env: Mapping[str, str], log_path: Path, bound_s: float) -> Exited:
    """``python -m worker run`` until it exits; fails if it still runs after ``bound_s``."""
    started = time.monotonic()
    return wait_exit(spawn_worker(env, log_path), log_path, bound_s, started)


def wait_exit(
    process: subprocess.Popen[bytes], log_path: Path, bound_s: float, since: float
) -> Exited:
    """Wait for a worker process to exit (killed, and the test failed, after ``bound_s``);
    ``seconds`` counts from ``since`` (a ``time.monotonic()`` reading)."""
    try:
        code = process.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError(
            f"worker still running after {bound_s} s:\n{log_path.read_text()[-3000:]}"
        ) from None
    return Exited(code, time.monotonic() - since, log_path.read_text().splitlines())


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


async def wait_logged(
    proc: subprocess.Popen[bytes], log_path: Path, event: str, timeout_s: float = 60
) -> None:
    """Wait until a worker process has logged ``event`` (fails if it exits first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = (await asyncio.to_thread(log_path.read_text)).splitlines()
        if event in Exited(0, 0.0, lines).events():
            return
        assert proc.poll() is None, f"worker exited with {proc.returncode} before {event}"
        assert time.monotonic() < deadline, f"no {event} in {timeout_s} s"
        await asyncio.sleep(0.1)  # reading another process's log: nothing to await


def metrics_text(port: int) -> str:
    """A worker process's ``/metrics`` exposition (a loaded worker may take seconds to answer)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return str(response.read().decode())


def metric_sum(port: int, name: str) -> float:
    """The sum over every label set of one metric, read from a worker process's ``/metrics``."""
    text = metrics_text(port)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def log_events(log_path: Path, event: str) -> list[dict[str, Any]]:
    """The JSON log lines of a worker process that carry ``event``."""
    found = []
    for line in log_path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("event") == event:
                found.append(entry)
    return found


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
    """Print one line of the reliability page's table (visible with ``pytest -s``)."""
    answered = len(got)
    recovery = f"{recovery_s:.1f} s" if recovery_s is not None else "-"
    print(
        f"\nRELIABILITY | {scenario} | {sent} | {sent - answered} | {got.duplicates} | "
        f"{len(got.dead_letters)} | {recovery} |"
    )
