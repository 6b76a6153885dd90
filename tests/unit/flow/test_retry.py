"""Backoff with full jitter, the deadline budget a record's tries share, the state they tell."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import pytest

from worker import errors
from worker.flow.breaker import CircuitBreaker
from worker.flow.holds import Listing, ModelGate
from worker.flow.model_health import ModelHealth
from worker.flow.retry import Backoff, Budget, Retrier, RetryPolicy
from worker.observability.inflight import InFlight

pytestmark = pytest.mark.timeout(10)


def test_the_cap_doubles_per_failure_up_to_the_maximum() -> None:
    """first, 2x, 4x ... never above max."""
    backoff = Backoff(first_s=0.1, max_s=0.5)
    assert [backoff.cap_s(n) for n in range(1, 6)] == [0.1, 0.2, 0.4, 0.5, 0.5]


def test_waits_are_drawn_below_the_cap() -> None:
    """Full jitter: every wait is in [0, cap); they differ (workers do not retry together)."""
    random.seed(7)
    backoff = Backoff(first_s=1.0, max_s=8.0)
    waits = [backoff.delay_s(3) for _ in range(200)]
    assert all(0 <= w <= 4.0 for w in waits)
    assert len(set(waits)) > 150 and max(waits) > 3.0 and min(waits) < 1.0


def test_a_paused_budget_gives_the_waiting_time_back() -> None:
    """Time spent waiting for an outage to end is not taken from the record."""
    budget = Budget.lasting(10.0)
    before = budget.remaining_s()
    budget.pause(5.0)
    assert 14.0 < budget.remaining_s() <= before + 5.0


# -- where a record is, as its tries go ------------------------------------------------


def _retrier(breaker: CircuitBreaker | None = None, models: ModelGate | None = None) -> Retrier:
    policy = RetryPolicy(
        max_attempts=3,
        backoff=Backoff(first_s=0.05, max_s=0.05),
        record_deadline_s=10.0,
        try_timeout_s=1.0,
    )
    breaker = breaker or CircuitBreaker(5)
    return Retrier(policy, breaker, models, lambda code: None, on_success=_reset(breaker))


def _reset(breaker: CircuitBreaker) -> Callable[[tuple[str, str] | None, bool], None]:
    """What the steps do with a success, for the circuit breaker."""
    return lambda _model, _probe: breaker.record_success()


async def test_a_retrying_record_tells_its_attempt_and_next_try() -> None:
    """After a retryable failure the entry says retrying, try 2, due within the backoff."""
    entry = InFlight("in", 0, 1, time.monotonic())
    budget = Budget.lasting(10.0)
    budget.entry = entry
    failed, states = asyncio.Event(), []

    async def call(timeout_s: float) -> str:
        states.append(entry.state)
        if not failed.is_set():
            failed.set()
            raise errors.TritonOverloaded("queue full")
        return "answer"

    started = time.monotonic()
    running = asyncio.create_task(_retrier().run(("m", ""), budget, call))
    await failed.wait()
    # The retrier went on to its backoff sleep before this task resumed: the next try is
    # due within the backoff of the failure, which came between ``started`` and now (a
    # loaded machine may resume this task after that moment has passed).
    assert (entry.state, entry.attempt) == ("retrying", 2)
    assert started <= entry.next_try_at <= time.monotonic() + 0.05
    assert await running == "answer"
    assert states == ["sent", "sent"] and entry.state == "sent"


async def test_a_record_held_by_an_outage_says_so() -> None:
    """Triton unavailable with the breaker opening: the entry is held_outage until it closes."""
    entry = InFlight("in", 0, 1, time.monotonic())
    budget = Budget.lasting(10.0)
    budget.entry = entry
    breaker = CircuitBreaker(1)
    tries = 0

    async def call(timeout_s: float) -> str:
        nonlocal tries
        tries += 1
        if tries == 1:
            raise errors.TritonUnavailable("connection refused")
        return "answer"

    running = asyncio.create_task(_retrier(breaker).run(("m", ""), budget, call))
    await breaker.wait_open()
    assert entry.state == "held_outage"
    breaker.close()
    # mypy keeps entry.state narrowed to "held_outage" across the await.
    assert await running == "answer" and entry.state == "sent"  # type: ignore[comparison-overlap]


async def test_a_record_held_for_its_model_says_so() -> None:
    """A model being reloaded: the entry is held_model until the probe finds it ready."""
    probed, ready = asyncio.Event(), asyncio.Event()

    async def is_ready(name: str, version: str) -> bool:
        probed.set()
        return ready.is_set()

    async def listed(name: str, version: str) -> Listing:
        return Listing(listed=True)

    gate = ModelGate(seen_ready=lambda n, v: True, listed=listed, ready=is_ready, interval_s=0.001)
    entry = InFlight("in", 0, 1, time.monotonic())
    budget = Budget.lasting(10.0)
    budget.entry = entry
    tries = 0

    async def call(timeout_s: float) -> str:
        nonlocal tries
        tries += 1
        if tries == 1:
            raise errors.ModelNotReady("'m' has no available versions")
        return "answer"

    probing = asyncio.create_task(gate.probe_loop())
    running = asyncio.create_task(_retrier(models=gate).run(("m", ""), budget, call))
    await probed.wait()
    assert entry.state == "held_model"
    ready.set()
    assert await running == "answer"
    probing.cancel()


async def test_a_failover_is_sent_again_at_once_and_never_opens_the_breaker() -> None:
    """Five records lose their endpoint mid-stream (another up): retried, breaker closed."""
    breaker = CircuitBreaker(5)
    retried: list[str] = []
    policy = RetryPolicy(
        max_attempts=3,
        backoff=Backoff(first_s=60.0, max_s=60.0),  # a backoff would outlast the test
        record_deadline_s=10.0,
        try_timeout_s=1.0,
    )
    retrier = Retrier(policy, breaker, None, retried.append, on_success=_reset(breaker))

    async def record() -> str:
        tries = 0

        async def call(timeout_s: float) -> str:
            nonlocal tries
            tries += 1
            if tries <= 2:
                raise errors.TritonFailover("the inference stream broke; sent again")
            return "answer"

        return await retrier.run(("tokens", ""), Budget.lasting(10.0), call)

    assert await asyncio.gather(*(record() for _ in range(5))) == ["answer"] * 5
    assert not breaker.is_open and breaker.opened_at is None
    assert retried == ["TRITON_UNAVAILABLE"] * 10


async def test_a_failover_past_the_deadline_is_retries_exhausted() -> None:
    """A record whose deadline is spent is not sent again, failover or not."""
    budget = Budget(time.monotonic() - 1.0)

    async def call(timeout_s: float) -> str:
        raise errors.TritonFailover("the inference stream broke; sent again")

    with pytest.raises(errors.RetriesExhausted, match="TRITON_UNAVAILABLE"):
        await _retrier().run(("tokens", ""), budget, call)


async def test_each_success_is_reported_with_its_model_when_it_is_an_inference() -> None:
    """on_success(model, probe): the model (its health counts it) only for an inference
    under a failure-rate breaker; None for a lookup, or without one."""
    reports: list[tuple[tuple[str, str] | None, bool]] = []
    policy = RetryPolicy(3, Backoff(0.001, 0.002), 10.0, 1.0)
    health = ModelHealth(failure_rate=0.5, window=10, min_samples=5, probe_interval_s=1.0)

    async def call(timeout_s: float) -> str:
        return "answer"

    for with_health in (health, None):
        retrier = Retrier(
            policy,
            CircuitBreaker(5),
            None,
            lambda _code: None,
            with_health,
            on_success=lambda model, probe: reports.append((model, probe)),
        )
        await retrier.run(("m", "1"), Budget.lasting(5.0), call)
        await retrier.run(("m", "1"), Budget.lasting(5.0), call, inference=False)
    assert reports == [(("m", "1"), False), (None, False), (None, False), (None, False)]
