"""Token streams on two Triton endpoints, one killed mid-stream: the other answers them.

Two Triton servers of this module's own serve the decoupled ``tokens`` model; the
worker (in this process, real Kafka) spreads long token streams over both, then one
server is SIGKILLed while each of its requests has responses out and more to come.
Its requests must go to the other endpoint as failovers: the worker-wide breaker
stays closed, ``/readyz`` stays 200 and no partition pauses, because one endpoint
still serves.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devtools.devstack.paths import models_dir
from devtools.devstack.process import free_port
from devtools.devstack.triton import TritonServer, ensure_triton
from devtools.samples import expected_tokens, token_request
from tests.support import (
    KafkaUnderTest,
    Topics,
    collect_streams,
    create,
    headers_dict,
    result_outputs,
    running_worker,
    send,
    settings_for,
)
from worker.app import Worker

pytestmark = pytest.mark.timeout(300)

TEXT = "one two three four five six seven"
TOKENS = 60
DELAY_MS = 100  # six seconds a stream: it outlasts the time it takes to see them all start
REQUESTS = 12


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[list[TritonServer]]:
    """Two Triton servers serving `tokens`, stopped after the test (the killed one too)."""
    install = ensure_triton(log=lambda _: None)
    servers = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        servers.append(TritonServer(install, models_dir(), tmp_path / name, models=["tokens"]))
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


class Watch:
    """Samples, from a thread, what an operator sees while the fault lasts: /readyz,
    paused partitions, the breaker (polling is how these are observed from outside)."""

    def __init__(self, port: int, worker: Worker) -> None:
        self.ready: list[int] = []
        self.paused: list[float] = []
        self.breaker_open: list[bool] = []
        self._port, self._worker = port, worker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                url = f"http://127.0.0.1:{self._port}/readyz"
                with urllib.request.urlopen(url, timeout=5) as response:
                    self.ready.append(response.status)
            except urllib.error.HTTPError as exc:
                self.ready.append(exc.code)
            self.paused.append(self._worker.metrics.paused_partitions._value.get())
            self.breaker_open.append(self._worker.breaker.is_open)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _streams_on(worker: Worker, server: TritonServer) -> int:
    """Decoupled requests the worker has in flight on ``server`` (its streams' own count)."""
    return worker.pool.endpoints.endpoints[server.grpc_address].pool.in_flight()


def _sample(worker: Worker, metric: str, **labels: str) -> float:
    return worker.metrics.registry.get_sample_value(metric, labels) or 0.0


async def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll the worker's own state until ``condition()`` holds (fails after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_decoupled_requests_on_a_killed_endpoint_fail_over_to_the_other(
    kafka: KafkaUnderTest, pair: list[TritonServer], unique: str
) -> None:
    """SIGKILL the endpoint holding half the token streams: all answered, breaker shut, ready."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    port = free_port()
    url = ",".join(server.grpc_address for server in pair)
    settings = settings_for(
        kafka, pair[0], topics, triton_url=url, metrics_port=str(port), max_in_flight="32"
    )
    requests = [token_request(f"t{i}", TEXT, TOKENS, delay_ms=DELAY_MS) for i in range(REQUESTS)]
    async with running_worker(settings) as worker:
        held = worker.metrics.triton_endpoint_in_flight
        await send(kafka.bootstrap_servers, topics.input, requests)
        first = "worker_stream_first_response_seconds_count"
        await _until(lambda: _sample(worker, first, model="tokens") >= REQUESTS, 60, "streams")
        victim = max(pair, key=lambda server: _streams_on(worker, server))
        holding = _streams_on(worker, victim)
        assert holding >= 5, f"the victim holds {holding} streams"
        gauge = held.labels(victim.grpc_address)._value.get()
        with Watch(port, worker) as watch:
            await asyncio.to_thread(victim.kill)
            got = await collect_streams(
                kafka.bootstrap_servers, topics, [f"t{i}" for i in range(REQUESTS)], timeout_s=120
            )
        failed_over = _sample(
            worker,
            "worker_triton_endpoint_requests_total",
            endpoint=victim.grpc_address,
            outcome="unavailable",
        )
    assert victim.death_report() is not None, "the kill left no trace"
    assert worker.breaker.opened_at is None and not any(watch.breaker_open)
    assert watch.ready and set(watch.ready) == {200}, watch.ready
    assert set(watch.paused) == {0}, watch.paused
    assert failed_over == holding, "every stream it held was lost and sent again"
    assert gauge == holding  # decoupled requests count in the endpoint's in-flight gauge
    assert got.dead_letters == {}
    for i in range(REQUESTS):
        (result,) = got.results[f"t{i}"]
        assert result_outputs(result)["text_output"] == expected_tokens(TEXT, TOKENS)
        assert headers_dict(result.headers)["x-response-count"] == str(TOKENS).encode()
