"""Fixtures of the unit tests: workers built on unused addresses, stopped after the test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import pytest

from tests.support.worker import clear_settings
from worker.app import Worker
from worker.settings import load_settings

#: A worker's topics; its Kafka and Triton addresses are the defaults, where nothing runs.
BASE_ENV = {
    "WORKER_INPUT_TOPICS": "in",
    "WORKER_OUTPUT_TOPIC": "out",
    "WORKER_DLQ_TOPIC": "dlq",
    "WORKER_METRICS_PORT": "0",
}


class MakeWorker(Protocol):
    """Builds a worker; ``settings``: SETTING_NAME=value, as ``WORKER_SETTING_NAME``."""

    def __call__(self, **settings: str) -> Worker: ...


@pytest.fixture
async def make_worker() -> AsyncIterator[MakeWorker]:
    """A factory of workers (nothing started but what a test starts); every worker it
    built is stopped after the test, whatever the test did with it."""
    built: list[Worker] = []

    def make(**settings: str) -> Worker:
        env = {**BASE_ENV, **{f"WORKER_{k.upper()}": v for k, v in settings.items()}}
        worker = Worker(load_settings(env))
        built.append(worker)
        return worker

    yield make
    for worker in built:
        await worker.stop()


@pytest.fixture(autouse=True)
def no_worker_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests see no WORKER_* variable but those they set: the run's own (such as
    WORKER_TEST_KAFKA_CLIENT, which picks the client of the integration tests) is an
    unknown setting to the commands, which refuse it."""
    clear_settings(monkeypatch)
