"""The circuit breaker for Triton outages: opens at the threshold, closes on a good probe."""

from __future__ import annotations

import asyncio

import pytest

from worker.flow.breaker import CircuitBreaker

pytestmark = pytest.mark.timeout(10)


async def test_consecutive_failures_open_it_and_a_success_resets_the_count() -> None:
    """Threshold 3: two failures, a success, two more stay closed; the third opens."""
    changes: list[bool] = []
    breaker = CircuitBreaker(3, on_change=changes.append)
    for _ in range(2):
        breaker.record_failure()
    breaker.record_success()
    for _ in range(2):
        breaker.record_failure()
    assert not breaker.is_open
    breaker.record_failure()
    assert breaker.is_open and changes == [True]


async def test_waiters_resume_when_a_probe_finds_triton_up() -> None:
    """wait_closed blocks while open; the probe loop's first good probe closes it."""
    breaker = CircuitBreaker(1)
    breaker.open()
    healthy = asyncio.Event()
    reported = asyncio.Event()
    reports: list[tuple[bool, bool]] = []

    async def probe() -> bool:
        return healthy.is_set()

    def report(up: bool, is_open: bool) -> None:
        reports.append((up, is_open))
        reported.set()

    waiter = asyncio.create_task(breaker.wait_closed())
    loop = asyncio.create_task(breaker.probe_loop(probe, 0.001, report))
    await reported.wait()
    assert not waiter.done() and reports[0] == (False, True)
    healthy.set()
    waited_s = await asyncio.wait_for(waiter, 1)
    loop.cancel()
    assert waited_s > 0 and not breaker.is_open
