"""Several Triton endpoints: load spread, one killed mid-stream and back, a name of several.

Three Triton servers of this module's own, serving the same model repository: A on
127.0.0.1:P, B on 127.0.0.2:P (Linux routes all of 127.0.0.0/8 to loopback, so the
same port on another address is another server) and C on 127.0.0.1:Q. A name that
resolves to A's and B's addresses is played by a resolver at the pool's seam: the
test cannot change this host's DNS, while the servers behind it are real.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from devtools import samples
from devtools.devstack.paths import models_dir
from devtools.devstack.process import free_port
from devtools.devstack.triton import TritonPorts, TritonServer, ensure_triton
from tests.support import (
    KafkaUnderTest,
    Topics,
    collect,
    create,
    decode_sample,
    report,
    running_worker,
    send,
    settings_for,
)
from worker.checks.report import run_checks
from worker.observability.metrics import Metrics
from worker.triton.pool import TritonPool

pytestmark = pytest.mark.timeout(300)


class Trio:
    """Three servers and the addresses the worker dials them by."""

    def __init__(self, servers: list[TritonServer], addresses: list[str]) -> None:
        self.servers = servers
        self.addresses = addresses

    @property
    def url(self) -> str:
        return ",".join(self.addresses)

    @property
    def grpc_address(self) -> str:  # what settings_for reads: the whole list
        return self.url


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    """Three Triton servers with `double` (A and C on 127.0.0.1, B on 127.0.0.2 at A's port)."""
    install = ensure_triton(log=lambda _: None)
    first = TritonServer(install, models_dir(), tmp_path_factory.mktemp("a"), models=["double"])
    port = first.ports.grpc
    second = TritonServer(
        install,
        models_dir(),
        tmp_path_factory.mktemp("b"),
        models=["double"],
        extra_args=["--grpc-address=127.0.0.2"],
        ports=TritonPorts(grpc=port, http=free_port(), metrics=free_port()),
    )
    third = TritonServer(install, models_dir(), tmp_path_factory.mktemp("c"), models=["double"])
    servers = [first, second, third]
    try:
        for server in servers:
            server.start()
        yield Trio(servers, [f"127.0.0.1:{port}", f"127.0.0.2:{port}", third.grpc_address])
    finally:
        for server in servers:
            server.stop()


def _requests_ok(metrics: Metrics, endpoint: str) -> float:
    value: float = metrics.triton_endpoint_requests_total.labels(endpoint, "ok")._value.get()
    return value


async def _until(condition: Any, timeout_s: float, what: str) -> None:
    """Poll observable state until ``condition()`` holds (fails after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_load_is_spread_over_every_endpoint(
    kafka: KafkaUnderTest, trio: Trio, unique: str
) -> None:
    """900 records through three endpoints: all answered, each endpoint serves a share."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=3)
    requests = samples.good_requests(900, seed=61, models=("double",))
    metrics = Metrics()
    async with running_worker(settings_for(kafka, trio, topics)) as worker:
        metrics = worker.metrics
        await send(kafka.bootstrap_servers, topics.input, requests)
        got = await collect(kafka.bootstrap_servers, topics, len(requests), 120)
        assert worker.breaker.opened_at is None
    report("three Triton endpoints", len(requests), got)
    assert got.dead_letters == {}
    assert set(got.results) == {r.request_id for r in requests}
    served = {address: _requests_ok(metrics, address) for address in trio.addresses}
    total = sum(served.values())
    assert all(count >= total * 0.1 for count in served.values()), served


async def test_an_endpoint_killed_mid_stream_then_back(
    kafka: KafkaUnderTest, trio: Trio, unique: str
) -> None:
    """SIGKILL one of three while records flow: none dead, breaker shut; restarted, it serves."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=3)
    requests = samples.good_requests(4000, seed=62, models=("double",))
    later = samples.good_requests(600, seed=63, models=("double",))
    victim, address = trio.servers[1], trio.addresses[1]
    # The last 1,000 are written after the kill, so the stream outlasts it however fast the
    # worker answers. Throttled (a small window, no batching) so that it is still answering
    # the first 3,000 then.
    settings = settings_for(
        kafka, trio, topics, breaker_probe_interval_ms="200", max_in_flight="12", batch_max_size="1"
    )
    try:
        async with running_worker(settings) as worker:
            await send(kafka.bootstrap_servers, topics.input, requests[:3000])
            got = await collect(kafka.bootstrap_servers, topics, 200)
            assert _requests_ok(worker.metrics, address) > 0, "the victim had no share before"
            # Killed while it holds requests: those must move to the other endpoints.
            in_flight = worker.metrics.triton_endpoint_in_flight.labels(address)
            await _until(lambda: in_flight._value.get() >= 1, 30, "requests in flight on it")
            await asyncio.to_thread(victim.kill)
            await send(kafka.bootstrap_servers, topics.input, requests[3000:])
            assert victim.death_report() is not None, "the kill left no trace"
            got = await collect(kafka.bootstrap_servers, topics, len(requests), 120, into=got)
            assert worker.breaker.opened_at is None, "one endpoint down made an outage"
            moved = worker.metrics.triton_endpoint_requests_total.labels(address, "unavailable")
            assert moved._value.get() >= 1, "nothing was in flight on it: not a mid-stream kill"
            down = worker.metrics.triton_endpoint_up.labels(address)
            assert down._value.get() == 0
            served_before = _requests_ok(worker.metrics, address)
            await asyncio.to_thread(victim.start)
            await _until(lambda: down._value.get() == 1, 30, "the restarted endpoint back up")
            await send(kafka.bootstrap_servers, topics.input, later)
            got = await collect(
                kafka.bootstrap_servers, topics, len(requests) + len(later), 120, into=got
            )
            assert _requests_ok(worker.metrics, address) > served_before, (
                "no work after it came back"
            )
    finally:
        if not victim.running():  # the module's other tests need all three
            await asyncio.to_thread(victim.start)
    report(
        "one of three Triton endpoints killed (SIGKILL) and restarted",
        len(requests) + len(later),
        got,
    )
    assert got.dead_letters == {}
    assert set(got.results) == {r.request_id for r in [*requests, *later]}


def _double(rid: str, rng: np.random.Generator) -> Any:
    return decode_sample("double", samples.double_inputs(rng), rid).infer_request


async def test_a_name_of_several_addresses_is_one_endpoint_each(trio: Trio) -> None:
    """A name resolving to 127.0.0.1 and 127.0.0.2: both servers used; dropped, then re-added."""
    port = int(trio.addresses[0].rsplit(":", 1)[1])
    names = {"triton.test": ["127.0.0.1", "127.0.0.2"]}

    async def resolver(host: str, _port: int) -> list[str]:
        return list(names[host])

    metrics = Metrics()
    pool = TritonPool(f"triton.test:{port}", 2, resolver=resolver, metrics=metrics)
    await pool.start()
    rng = np.random.default_rng(64)
    try:
        a, b = f"127.0.0.1:{port}", f"127.0.0.2:{port}"
        assert sorted(pool.endpoints.endpoints) == [a, b]
        await pool.model_spec("double", "")
        await asyncio.gather(*(pool.infer(_double(f"r{i}", rng), 10) for i in range(60)))
        assert _requests_ok(metrics, a) > 0 and _requests_ok(metrics, b) > 0
        assert _requests_ok(metrics, a) + _requests_ok(metrics, b) == 60

        names["triton.test"] = ["127.0.0.1"]  # one address: the name itself is dialled
        await pool.refresh()
        assert list(pool.endpoints.endpoints) == [f"triton.test:{port}"]
        names["triton.test"] = ["127.0.0.1", "127.0.0.2"]
        await pool.refresh()
        assert sorted(pool.endpoints.endpoints) == [a, b]
        before = _requests_ok(metrics, b)
        await asyncio.gather(*(pool.infer(_double(f"s{i}", rng), 10) for i in range(40)))
        assert _requests_ok(metrics, b) > before
    finally:
        await pool.close()


async def test_check_is_ready_while_one_endpoint_answers(
    kafka: KafkaUnderTest, trio: Trio, unique: str
) -> None:
    """`check` probes each endpoint: ready with one down (named); failed with all down."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    dead = f"127.0.0.1:{free_port()}"
    settings = settings_for(
        kafka, trio, topics, triton_url=f"{trio.url},{dead}", default_model="double"
    )
    results = {r.check: r for r in await run_checks(settings, timeout_s=5.0)}
    assert results["Triton ready"].outcome == "ok"
    assert results["Triton ready"].detail.startswith("3 of 4 endpoints ready")
    assert dead in results["Triton ready"].detail
    assert results["model double"].outcome == "ok"

    settings = settings_for(kafka, trio, topics, triton_url=dead, default_model="double")
    results = {r.check: r for r in await run_checks(settings, timeout_s=5.0)}
    assert results["Triton ready"].outcome == "fail"


@pytest.fixture
def odd_triton(tmp_path: Path) -> Iterator[TritonServer]:
    """A Triton whose `double` is configured otherwise (max batch 8, not 64)."""
    repository = tmp_path / "models"
    shutil.copytree(models_dir() / "double", repository / "double")
    config = repository / "double" / "config.pbtxt"
    config.write_text(config.read_text().replace("max_batch_size: 64", "max_batch_size: 8"))
    server = TritonServer(
        ensure_triton(log=lambda _: None), repository, tmp_path / "work", models=["double"]
    )
    (tmp_path / "work").mkdir()
    server.start()
    yield server
    server.stop()


async def test_an_endpoint_with_other_model_metadata_is_not_used_for_it(
    trio: Trio, odd_triton: TritonServer
) -> None:
    """Two endpoints agree on `double`, a third differs: the agreed spec, nothing sent to it."""
    good = [trio.addresses[0], trio.addresses[2]]
    metrics = Metrics()
    pool = TritonPool(",".join([*good, odd_triton.grpc_address]), 2, metrics=metrics)
    await pool.start()
    rng = np.random.default_rng(65)
    try:
        spec = await pool.model_spec("double", "")
        assert spec.max_batch_size == 64
        await asyncio.gather(*(pool.infer(_double(f"m{i}", rng), 10) for i in range(40)))
    finally:
        await pool.close()
    assert _requests_ok(metrics, odd_triton.grpc_address) == 0
    assert sum(_requests_ok(metrics, address) for address in good) == 40
    assert all(_requests_ok(metrics, address) > 0 for address in good)
