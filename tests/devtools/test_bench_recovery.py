"""The benchmark measures again when the local Triton died under a measurement, a bounded
number of times."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from rich.console import Console

from devtools.bench.command import TRITON_DEATHS_TOLERATED, again_if_triton_died
from devtools.bench.runner import Servers


class _Triton:
    def __init__(self, alive: bool) -> None:
        self.alive, self.restarts, self.pid, self.log_path = alive, 0, 100, "tritonserver.log"

    def running(self) -> bool:
        return self.alive

    def restart(self) -> None:
        self.alive, self.restarts, self.pid = True, self.restarts + 1, 200


class _Stack:
    def __init__(self, alive: bool) -> None:
        self.triton = _Triton(alive)


def _flaky(failures: int) -> tuple[list[int], Any]:
    calls: list[int] = []

    async def measure() -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise RuntimeError("answered nothing")
        return "measured"

    return calls, measure


def test_a_measurement_is_made_again_after_triton_is_restarted() -> None:
    servers, stack = Servers("k:9092", "t:8001", triton_pid=100), _Stack(alive=False)
    calls, measure = _flaky(1)
    got = asyncio.run(
        again_if_triton_died("batching", measure, servers, stack, Console(quiet=True))  # type: ignore[arg-type]
    )
    assert (got, len(calls), stack.triton.restarts, servers.triton_pid) == ("measured", 2, 1, 200)


def test_a_failure_with_triton_up_or_a_second_failure_is_raised() -> None:
    servers = Servers("k:9092", "t:8001")
    _, measure = _flaky(1)
    with pytest.raises(RuntimeError):
        asyncio.run(
            again_if_triton_died("x", measure, servers, _Stack(alive=True), Console(quiet=True))  # type: ignore[arg-type]
        )
    calls, measure = _flaky(2)
    with pytest.raises(RuntimeError):
        asyncio.run(
            again_if_triton_died("x", measure, servers, _Stack(alive=False), Console(quiet=True))  # type: ignore[arg-type]
        )
    assert len(calls) == 2


def _killing_triton(stack: _Stack, deaths: int) -> tuple[list[int], Any]:
    calls: list[int] = []

    async def measure() -> str:
        calls.append(1)
        if len(calls) <= deaths:
            stack.triton.alive = False
            raise RuntimeError("no new result for 60 s")
        return "measured"

    return calls, measure


@pytest.mark.parametrize("deaths", [TRITON_DEATHS_TOLERATED, TRITON_DEATHS_TOLERATED + 1])
def test_triton_dying_under_each_try_is_measured_again_up_to_the_bound(deaths: int) -> None:
    servers, stack = Servers("k:9092", "t:8001"), _Stack(alive=True)
    calls, measure = _killing_triton(stack, deaths)
    run = again_if_triton_died("x", measure, servers, stack, Console(quiet=True))  # type: ignore[arg-type]
    if deaths > TRITON_DEATHS_TOLERATED:
        with pytest.raises(RuntimeError):
            asyncio.run(run)
    else:
        assert asyncio.run(run) == "measured"
    assert (len(calls), stack.triton.restarts) == (
        min(deaths, TRITON_DEATHS_TOLERATED) + 1,
        min(deaths, TRITON_DEATHS_TOLERATED),
    )
