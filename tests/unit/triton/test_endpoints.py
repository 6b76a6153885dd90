"""Several Triton endpoints: least-outstanding choice, resolution, per-endpoint health.

The per-endpoint pools are in-memory fakes at the ``ServerPool`` seam and the
resolver is a dict: a real Triton cannot be made to fail on cue for one request, and
a real DNS cannot be changed by a unit test (the integration tests use real servers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
import structlog
from tritonclient.grpc import service_pb2

from worker import errors
from worker.observability.metrics import Metrics
from worker.triton import pool as pool_module
from worker.triton.endpoints import Endpoint, EndpointSet, Target, parse_targets, system_resolver
from worker.wire.validation import ModelSpec, TensorSpec

MODEL = ("double", "")


def _spec(width: int = 4) -> ModelSpec:
    tensor = TensorSpec(name="INPUT0", datatype="FP32", shape=(width,))
    return ModelSpec(
        name="double", version="", inputs=(tensor,), outputs=(tensor,), max_batch_size=8
    )


class FakeServer:
    """A ServerPool stand-in: answers, or fails as unreachable, as the test says."""

    def __init__(self, address: str, streams: int, **_: Any) -> None:
        self.address = address
        self.live = True
        self.spec = _spec()
        self.served: list[str] = []
        self.gate: asyncio.Event | None = None
        self.woken = 0
        self.started = False
        self.closed = asyncio.Event()
        self.entered = asyncio.Event()

    async def start(self) -> None:
        self.started = True

    async def close(self, drain_timeout_s: float = 10.0) -> None:
        self.closed.set()

    async def infer(self, request: Any, timeout_s: float, trace: Any = ()) -> Any:
        if not self.live:
            raise errors.TritonUnavailable("the inference stream broke: connection reset")
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        self.served.append(request.id)
        return service_pb2.ModelInferResponse(id=request.id)

    async def server_live(self, timeout_s: float = 2.0) -> bool:
        return self.live

    async def model_spec(self, name: str, version: str) -> ModelSpec:
        if not self.live:
            raise errors.TritonUnavailable("unreachable")
        return self.spec

    def wake(self) -> None:
        self.woken += 1

    def forget_model(self, name: str) -> None:
        pass

    def in_flight(self) -> int:
        return 0


class Resolver:
    """Names to addresses, changed by the test; a missing name does not resolve."""

    def __init__(self, names: dict[str, list[str]]) -> None:
        self.names = names

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        if host not in self.names:
            raise OSError(f"{host}: Name or service not known")
        return self.names[host]


@pytest.fixture
def fake_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_module, "ServerPool", FakeServer)


def _servers(pool: pool_module.TritonPool) -> dict[str, FakeServer]:
    return {e.address: e.pool for e in pool.endpoints}


def _request(n: int) -> service_pb2.ModelInferRequest:
    return service_pb2.ModelInferRequest(model_name="double", id=str(n))


def test_targets_are_parsed_and_deduplicated() -> None:
    """A comma-separated list, spaces tolerated, the same target once, IPv6 in brackets."""
    targets = parse_targets("a:8001, b:8002,a:8001,[::1]:8001")
    assert targets == (Target("a", 8001), Target("b", 8002), Target("[::1]", 8001))
    assert [t.is_address for t in targets] == [False, False, True]
    assert str(targets[2]) == "[::1]:8001"


async def test_least_outstanding_endpoint_is_chosen_and_ties_rotate() -> None:
    """The endpoint owing fewest responses gets the request; equal ones take turns."""
    endpoints: EndpointSet[object] = EndpointSet(
        parse_targets("10.0.0.1:1,10.0.0.2:1,10.0.0.3:1"), lambda a, t: object()
    )
    await endpoints.refresh()
    ordered: list[Endpoint[object]] = list(endpoints)
    first, second, third = ordered
    first.outstanding, second.outstanding, third.outstanding = 3, 1, 2
    assert endpoints.choose(MODEL) is second
    second.outstanding = 5
    assert endpoints.choose(MODEL) is third
    for endpoint in endpoints:
        endpoint.outstanding = 0
    picked = {endpoints.choose(MODEL).address for _ in range(6)}  # type: ignore[union-attr]
    assert picked == {"10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"}


async def test_down_endpoints_get_no_requests_while_another_is_up() -> None:
    """A down endpoint is skipped even when idle; when all are down a first try still goes."""
    endpoints: EndpointSet[object] = EndpointSet(
        parse_targets("10.0.0.1:1,10.0.0.2:1"), lambda a, t: object()
    )
    await endpoints.refresh()
    first, second = list(endpoints)
    second.outstanding = 50
    first.mark_down("test")
    assert all(endpoints.choose(MODEL) is second for _ in range(5))
    second.mark_down("test")
    assert endpoints.choose(MODEL) is not None  # an outage: the breaker must hear of it
    assert endpoints.choose(MODEL, avoid=[first.address]) is None  # no retry onto a down one


async def test_a_sequence_stays_on_one_endpoint() -> None:
    """Requests of one sequence id go to one endpoint, and stay when another one leaves."""
    resolver = Resolver({"triton": ["10.0.0.1", "10.0.0.2", "10.0.0.3"]})
    endpoints: EndpointSet[object] = EndpointSet(
        parse_targets("triton:1"), lambda a, t: object(), resolver
    )
    await endpoints.refresh()
    homes = {seq: endpoints.choose(MODEL, sticky=seq) for seq in (b"s1", b"s2", b"s3", b"s4")}
    assert all(endpoints.choose(MODEL, sticky=seq) is home for seq, home in homes.items())
    leaving = next(iter(endpoints))
    resolver.names["triton"] = [
        a.split(":")[0] for a in endpoints.endpoints if a != leaving.address
    ]
    await endpoints.refresh()
    for seq, home in homes.items():
        if home is not leaving:
            assert endpoints.choose(MODEL, sticky=seq) is home


async def test_resolution_follows_the_name() -> None:
    """Addresses come and go with the name; one address keeps the name; DNS errors keep all."""
    resolver = Resolver({"triton": ["10.0.0.1"]})
    endpoints: EndpointSet[str] = EndpointSet(
        parse_targets("triton:8001"), lambda a, t: a, resolver
    )
    added, removed = await endpoints.refresh()
    assert [e.address for e in added] == ["triton:8001"] and removed == []
    resolver.names["triton"] = ["10.0.0.1", "10.0.0.2"]
    added, removed = await endpoints.refresh()
    assert sorted(e.address for e in added) == ["10.0.0.1:8001", "10.0.0.2:8001"]
    assert [e.address for e in removed] == ["triton:8001"]
    resolver.names["triton"] = ["10.0.0.2", "10.0.0.3"]
    added, removed = await endpoints.refresh()
    assert [e.address for e in added] == ["10.0.0.3:8001"]
    assert [e.address for e in removed] == ["10.0.0.1:8001"]
    del resolver.names["triton"]
    assert await endpoints.refresh() == ([], [])
    assert sorted(endpoints.endpoints) == ["10.0.0.2:8001", "10.0.0.3:8001"]


async def test_a_name_that_never_resolved_stands_for_itself() -> None:
    """An unresolvable name is dialled as is: gRPC keeps trying it, as with one endpoint."""
    endpoints: EndpointSet[str] = EndpointSet(
        parse_targets("nowhere:8001"), lambda a, t: a, Resolver({})
    )
    await endpoints.refresh()
    assert list(endpoints.endpoints) == ["nowhere:8001"]


async def test_a_request_on_a_dead_endpoint_is_answered_by_another(fake_servers: None) -> None:
    """Unreachable mid-request: marked down, the request answered elsewhere, no error seen."""
    metrics = Metrics()
    pool = pool_module.TritonPool("10.0.0.1:1,10.0.0.2:1", 1, metrics=metrics)
    await pool.start()
    servers = _servers(pool)
    servers["10.0.0.1:1"].live = False
    answers = [await pool.infer(_request(n), 1.0) for n in range(6)]
    assert [a.id for a in answers] == [str(n) for n in range(6)]
    assert len(servers["10.0.0.2:1"].served) == 6
    assert metrics.triton_endpoint_up.labels("10.0.0.1:1")._value.get() == 0
    assert (
        metrics.triton_endpoint_requests_total.labels("10.0.0.1:1", "unavailable")._value.get() == 1
    )
    assert metrics.triton_endpoint_requests_total.labels("10.0.0.2:1", "ok")._value.get() == 6
    await pool.close()


async def test_only_when_every_endpoint_is_down_is_it_an_outage(fake_servers: None) -> None:
    """One endpoint live: live; none: not live, and a request fails as TritonUnavailable."""
    pool = pool_module.TritonPool("10.0.0.1:1,10.0.0.2:1", 1)
    await pool.start()
    servers = _servers(pool)
    servers["10.0.0.1:1"].live = False
    assert await pool.server_live() is True
    servers["10.0.0.2:1"].live = False
    assert await pool.server_live() is False
    with pytest.raises(errors.TritonUnavailable):
        await pool.infer(_request(1), 1.0)
    servers["10.0.0.1:1"].live = True
    assert await pool.server_live() is True
    assert servers["10.0.0.1:1"].woken == 1  # its broken streams re-open at once
    assert (await pool.infer(_request(2), 1.0)).id == "2"
    await pool.close()


async def test_outstanding_requests_steer_new_ones(fake_servers: None) -> None:
    """A request held by one endpoint sends every next one to the others, both used."""
    pool = pool_module.TritonPool("10.0.0.1:1,10.0.0.2:1,10.0.0.3:1", 1)
    await pool.start()
    servers = _servers(pool)
    gate = asyncio.Event()
    for server in servers.values():
        server.gate = gate
    held = asyncio.create_task(pool.infer(_request(0), 5.0))
    entered = [asyncio.create_task(s.entered.wait()) for s in servers.values()]
    await asyncio.wait(entered, return_when=asyncio.FIRST_COMPLETED)
    for waiter in entered:
        waiter.cancel()
    busy = next(e for e in pool.endpoints if e.outstanding)
    for address, server in servers.items():
        if address != busy.address:
            server.gate = None
    for n in range(1, 9):
        await pool.infer(_request(n), 1.0)
    others = [s for a, s in servers.items() if a != busy.address]
    assert sum(len(s.served) for s in others) == 8
    assert all(len(s.served) >= 2 for s in others)
    gate.set()
    await held
    assert servers[busy.address].served == ["0"]
    await pool.close()


async def test_an_endpoint_whose_model_differs_is_not_used_for_it(fake_servers: None) -> None:
    """Two endpoints agree, one reports other shapes: the agreed spec, and none sent to it."""
    pool = pool_module.TritonPool("10.0.0.1:1,10.0.0.2:1,10.0.0.3:1", 1)
    await pool.start()
    servers = _servers(pool)
    servers["10.0.0.2:1"].spec = _spec(width=8)
    assert await pool.model_spec("double", "") == _spec()
    for n in range(9):
        await pool.infer(_request(n), 1.0)
    assert servers["10.0.0.2:1"].served == []
    assert len(servers["10.0.0.1:1"].served) + len(servers["10.0.0.3:1"].served) == 9
    pool.forget_model("double")  # a reload: compared afresh
    servers["10.0.0.2:1"].spec = _spec()
    await pool.model_spec("double", "")
    for n in range(9):
        await pool.infer(_request(n), 1.0)
    assert servers["10.0.0.2:1"].served != []
    await pool.close()


async def test_an_endpoint_down_at_the_lookup_is_compared_before_its_first_request(
    fake_servers: None,
) -> None:
    """Down when the spec was agreed, back later with other metadata: still never used."""
    pool = pool_module.TritonPool("10.0.0.1:1,10.0.0.2:1", 1)
    await pool.start()
    servers = _servers(pool)
    late = servers["10.0.0.2:1"]
    late.live = False
    assert await pool.server_live() is True
    await pool.model_spec("double", "")
    late.live, late.spec = True, _spec(width=8)
    assert await pool.server_live() is True
    for n in range(6):
        await pool.infer(_request(n), 1.0)
    assert late.served == []
    await pool.close()


async def test_vanished_addresses_are_drained_and_closed(fake_servers: None) -> None:
    """A refresh opens new addresses' streams and closes those the name no longer has."""
    resolver = Resolver({"triton": ["10.0.0.1", "10.0.0.2"]})
    pool = pool_module.TritonPool("triton:1", 1, resolver=resolver, resolve_interval_s=3600)
    await pool.start()
    old = _servers(pool)
    assert sorted(old) == ["10.0.0.1:1", "10.0.0.2:1"] and all(s.started for s in old.values())
    resolver.names["triton"] = ["10.0.0.2", "10.0.0.3"]
    await pool.refresh()
    new = _servers(pool)
    assert sorted(new) == ["10.0.0.2:1", "10.0.0.3:1"] and new["10.0.0.3:1"].started
    await asyncio.wait_for(old["10.0.0.1:1"].closed.wait(), 5)
    await pool.close()


class Asked(Resolver):
    """A Resolver that tells each time it is asked, and raises ``error`` once when set."""

    def __init__(self, names: dict[str, list[str]]) -> None:
        super().__init__(names)
        self.error: Exception | None = None
        self._asked = asyncio.Event()

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self._asked.set()
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return await super().__call__(host, port)

    async def until(self, condition: Any, timeout_s: float = 5.0) -> None:
        """Wait, one resolution at a time, until ``condition()`` holds after one."""
        async with asyncio.timeout(timeout_s):
            while True:
                self._asked.clear()
                await self._asked.wait()
                if condition():
                    return


class FlakyStart(FakeServer):
    """A ServerPool whose first start() fails when its address is in ``failing``."""

    failing: set[str] = set()

    async def start(self) -> None:
        if self.address in self.failing:
            self.failing.discard(self.address)
            raise RuntimeError("the channel could not be created")
        await super().start()


async def test_an_endpoint_that_fails_to_start_is_left_out_and_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new address whose start() fails: out of rotation, the loop goes on, next time it joins."""
    monkeypatch.setattr(pool_module, "ServerPool", FlakyStart)
    monkeypatch.setattr(FlakyStart, "failing", {"10.0.0.3:1"})
    resolver = Asked({"triton": ["10.0.0.1", "10.0.0.2"]})
    pool = pool_module.TritonPool("triton:1", 1, resolver=resolver, resolve_interval_s=0.001)
    await pool.start()
    try:
        with structlog.testing.capture_logs() as logs:
            resolver.names["triton"] = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
            await resolver.until(lambda: not FlakyStart.failing)  # its start failed
            assert "10.0.0.3:1" not in pool.endpoints.endpoints
            await resolver.until(lambda: "10.0.0.3:1" in pool.endpoints.endpoints)
        assert _servers(pool)["10.0.0.3:1"].started
        assert [e["endpoint"] for e in logs if e["event"] == "triton_endpoint_start_failed"] == [
            "10.0.0.3:1"
        ]
    finally:
        await pool.close()


async def test_a_refresh_that_raises_does_not_end_the_resolution(fake_servers: None) -> None:
    """A resolver failing with other than OSError: logged, endpoints kept, resolved again later."""
    resolver = Asked({"triton": ["10.0.0.1", "10.0.0.2"]})
    pool = pool_module.TritonPool("triton:1", 1, resolver=resolver, resolve_interval_s=0.001)
    await pool.start()
    try:
        with structlog.testing.capture_logs() as logs:
            resolver.error = UnicodeError("label empty or too long")
            await resolver.until(lambda: resolver.error is None)
            resolver.names["triton"] = ["10.0.0.2", "10.0.0.4"]
            await resolver.until(lambda: "10.0.0.4:1" in pool.endpoints.endpoints)
        assert sorted(pool.endpoints.endpoints) == ["10.0.0.2:1", "10.0.0.4:1"]
        assert [e["event"] for e in logs if e["event"] == "triton_refresh_failed"] == [
            "triton_refresh_failed"
        ]
    finally:
        await pool.close()


def test_with_tls_an_address_is_checked_against_the_name() -> None:
    """A pod dialled by address keeps the TLS name of its target; a name dialled as is, none."""
    pool = pool_module.TritonPool("triton.svc:8001", 1, client_kwargs={"ssl": True})
    by_address = pool._make("10.0.0.7:8001", Target("triton.svc", 8001))
    by_name = pool._make("triton.svc:8001", Target("triton.svc", 8001))
    assert ("grpc.ssl_target_name_override", "triton.svc") in by_address._extra_channel_args
    assert by_name._extra_channel_args == ()
    plain = pool_module.TritonPool("triton.svc:8001", 1)._make("10.0.0.7:8001", Target("t", 1))
    assert plain._extra_channel_args == ()


def test_the_system_resolver_asks_the_real_resolver_once_per_address() -> None:
    """The name service's answer, sorted and deduplicated (getaddrinfo lists each address
    once per socket type and protocol); a literal address is itself."""
    local = asyncio.run(system_resolver("localhost", 8001))
    assert "127.0.0.1" in local and local == sorted(set(local))
    assert asyncio.run(system_resolver("127.0.0.2", 8001)) == ["127.0.0.2"]
