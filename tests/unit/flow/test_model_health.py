"""The per-model failure-rate breaker: window, minimum sample, probes, and its Retrier use."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import pytest

from worker import errors
from worker.flow.breaker import CircuitBreaker
from worker.flow.model_health import ModelHealth, Trip
from worker.flow.retry import Backoff, Budget, Retrier, RetryPolicy

pytestmark = pytest.mark.timeout(10)

M = ("m", "")
BAD = errors.InferenceError("Triton: model raised")


def health(
    *, rate: float = 0.5, window: int = 20, min_samples: int = 10, interval_s: float = 0.001
) -> tuple[ModelHealth, list[tuple[str, bool]]]:
    changes: list[tuple[str, bool]] = []
    gate = ModelHealth(
        failure_rate=rate,
        window=window,
        min_samples=min_samples,
        probe_interval_s=interval_s,
        on_change=lambda name, _version, is_open: changes.append((name, is_open)),
    )
    return gate, changes


def fail(gate: ModelHealth, times: int, model: tuple[str, str] = M) -> list[bool]:
    """``times`` INFERENCE_ERROR outcomes; whether each record was held."""
    return [gate.failed(model, BAD, probe=False) for _ in range(times)]


def succeed(gate: ModelHealth, times: int, model: tuple[str, str] = M) -> None:
    for _ in range(times):
        gate.succeeded(model, probe=False)


async def waiting(gate: ModelHealth, count: int) -> list[asyncio.Task[tuple[float, bool]]]:
    """``count`` records waiting at the open breaker, in that order."""
    tasks = [asyncio.create_task(gate.admit(M)) for _ in range(count)]
    await asyncio.sleep(0)  # let each reach its wait
    return tasks


def test_poison_pills_below_the_rate_are_dead_lettered_and_never_trip() -> None:
    """Half the window failing (not more than the rate) leaves the breaker closed."""
    gate, changes = health()
    for _ in range(10):
        succeed(gate, 1)
        assert fail(gate, 1) == [False]  # dead-lettered at once
    succeed(gate, 100)
    assert fail(gate, 1) == [False]
    assert not gate.is_open(*M) and changes == [] and gate.failing() == []


def test_no_trip_before_the_minimum_sample_then_the_sample_is_dead_lettered() -> None:
    """A fresh model: 9 failures do not trip (min 10); the 10th does; later ones are held."""
    gate, changes = health()
    assert fail(gate, 9) == [False] * 9 and not gate.is_open(*M)
    assert fail(gate, 1) == [False]  # the 10th is the last of the sample: dead-lettered
    assert gate.is_open(*M) and gate.failing() == ["m"] and changes == [("m", True)]
    assert gate.last_trip[M].failures == 10 and gate.last_trip[M].outcomes == 10
    assert fail(gate, 5) == [True] * 5  # after the trip: held
    assert changes == [("m", True)]


def test_the_window_slides_old_successes_out() -> None:
    """After a full window of successes it takes 11 failures of the last 20 to trip."""
    gate, _ = health()
    succeed(gate, 50)
    assert fail(gate, 10) == [False] * 10 and not gate.is_open(*M)
    assert fail(gate, 1) == [False] and gate.is_open(*M)
    trip = gate.last_trip[M]
    assert (trip.failures, trip.outcomes) == (11, 20) and isinstance(trip, Trip)


def test_models_and_versions_are_counted_apart() -> None:
    """One model's failures never trip another's breaker; a version has its own."""
    gate, _ = health(min_samples=5, window=5)
    fail(gate, 5, ("m", "2"))
    fail(gate, 4, ("other", ""))
    assert gate.failing() == ["m:2"] and not gate.is_open("m", "")


def test_other_errors_are_not_counted() -> None:
    """A timeout or an invalid request says nothing of the model's failure rate."""
    gate, _ = health(min_samples=2, window=2)
    for error in (errors.InvalidRequest("bad shape"), errors.TritonTimeout("late")) * 5:
        assert not gate.failed(M, error, probe=False)
    assert not gate.is_open(*M)


def test_a_rate_of_one_never_trips() -> None:
    """WORKER_MODEL_FAILURE_RATE=1: every failure is dead-lettered, as without the breaker."""
    gate, _ = health(rate=1.0)
    assert not any(fail(gate, 100)) and not gate.is_open(*M)


async def test_a_closed_breaker_admits_at_once() -> None:
    """No wait and no probe while the model is healthy."""
    gate, _ = health()
    assert await gate.admit(M) == (0.0, False)


async def test_one_probe_at_a_time_a_failed_probe_goes_to_the_back() -> None:
    """One waiter per probe; none while it is in flight; a failed probe waits behind the others."""
    gate, _ = health()
    fail(gate, 10)
    first, second, third = await waiting(gate, 3)
    assert gate.probe_once() == 1
    # pytest.approx(...) equals a float, which strict equality cannot tell from its type.
    assert await first == (pytest.approx(0, abs=1), True)  # type: ignore[comparison-overlap]
    assert gate.probe_once() == 0  # the probe is in flight: nobody else goes
    assert not second.done() and not third.done()
    assert gate.failed(M, BAD, probe=True)  # the probe failed: held again
    again = asyncio.create_task(gate.admit(M))  # it waits again, behind the others
    await asyncio.sleep(0)
    assert gate.probe_once() == 1
    assert (await second)[1] is True and not third.done() and not again.done()
    assert gate.is_open(*M)
    for task in (third, again):
        task.cancel()


async def test_a_probe_success_closes_and_releases_every_waiter() -> None:
    """The probe succeeds: the breaker closes, the others go (not as probes), outcomes reset."""
    gate, changes = health()
    fail(gate, 10)
    probe, *others = await waiting(gate, 4)
    gate.probe_once()
    assert (await probe)[1] is True
    gate.succeeded(M, probe=True)
    assert [(await task)[1] for task in others] == [False, False, False]
    assert not gate.is_open(*M) and changes == [("m", True), ("m", False)]
    # The bad release's outcomes are forgotten: a new minimum sample is needed.
    assert fail(gate, 9) == [False] * 9 and not gate.is_open(*M)


async def test_a_success_that_is_not_a_probe_does_not_close() -> None:
    """A record sent before the trip that succeeds says nothing of the failing requests."""
    gate, _ = health()
    fail(gate, 10)
    succeed(gate, 30)
    assert gate.is_open(*M)


async def test_a_cancelled_probe_frees_its_turn() -> None:
    """A probe cancelled (revoke, shutdown) before its outcome: the next waiter probes."""
    gate, _ = health()
    fail(gate, 10)
    probe, second = await waiting(gate, 2)
    gate.probe_once()
    probe.cancel()  # granted, cancelled before it ran
    with pytest.raises(asyncio.CancelledError):
        await probe
    assert gate.probe_once() == 1 and (await second)[1] is True


async def test_the_probe_loop_lets_one_record_through_per_interval() -> None:
    """With a probe failing every time, the loop grants one per interval, not faster."""
    interval_s = 0.05
    gate, _ = health(interval_s=interval_s)
    fail(gate, 10)
    granted: list[float] = []
    five = asyncio.Event()

    async def held_record() -> None:
        while True:
            _, probe = await gate.admit(M)
            if probe:
                granted.append(time.monotonic())
                if len(granted) == 5:
                    five.set()
                gate.failed(M, BAD, probe=True)

    records = [asyncio.create_task(held_record()) for _ in range(5)]
    loop = asyncio.create_task(gate.probe_loop())
    try:
        await five.wait()
    finally:
        loop.cancel()
        for task in records:
            task.cancel()
    gaps = [b - a for a, b in itertools.pairwise(granted)]
    assert min(gaps) >= 0.9 * interval_s, gaps


# -- through the Retrier ------------------------------------------------------------------


def retrier(gate: ModelHealth) -> Retrier:
    policy = RetryPolicy(
        max_attempts=3, backoff=Backoff(0.001, 0.01), record_deadline_s=5, try_timeout_s=1
    )
    return Retrier(
        policy, CircuitBreaker(5), None, lambda _code: None, gate, on_success=_succeeded(gate)
    )


def _succeeded(gate: ModelHealth) -> Callable[[tuple[str, str] | None, bool], None]:
    """What the steps do with a success, for the model's health."""

    def succeeded(model: tuple[str, str] | None, probe: bool) -> None:
        if model is not None:
            gate.succeeded(model, probe)

    return succeeded


class Model:
    """A fake model call: fails with INFERENCE_ERROR while ``broken``; counts the calls."""

    def __init__(self) -> None:
        self.broken = True
        self.calls = 0
        self.called = asyncio.Event()

    async def __call__(self, _timeout_s: float) -> str:
        self.calls += 1
        self.called.set()
        if self.broken:
            raise BAD
        return "ok"


async def test_retrier_dead_letters_the_sample_and_holds_the_rest_until_a_probe_succeeds() -> None:
    """Ten records fail and trip the breaker; the next ones wait, no try spent, then succeed."""
    gate, _ = health()
    run = retrier(gate)
    model = Model()
    for _ in range(10):
        with pytest.raises(errors.InferenceError):
            await run.run(M, Budget.lasting(5), model)
    assert gate.is_open(*M)
    budgets = [Budget.lasting(5) for _ in range(3)]
    held = [asyncio.create_task(run.run(M, b, model)) for b in budgets]
    await asyncio.sleep(0)
    model.called.clear()
    assert gate.probe_once() == 1  # the first probe fails: held again
    await model.called.wait()
    await asyncio.sleep(0)  # the probe's task goes back to its wait
    assert model.calls == 11 and gate.probe_once() == 1  # the next probe is another record
    model.called.clear()
    await model.called.wait()
    assert gate.is_open(*M) and not any(task.done() for task in held)
    model.broken = False  # the good release is back
    assert gate.probe_once() == 1
    await asyncio.wait_for(asyncio.gather(*held), 1)
    assert model.calls == 12 + 3  # one failed probe each for two records, then one each
    assert [task.result() for task in held] == ["ok"] * 3
    assert not gate.is_open(*M)
    assert all(b.failures == 0 for b in budgets)  # waiting was not a try


async def test_retrier_metadata_calls_are_not_outcomes() -> None:
    """inference=False: a metadata call neither waits at the open breaker nor counts."""
    gate, _ = health(min_samples=1, window=1)
    run = retrier(gate)

    async def metadata(_timeout_s: float) -> str:
        return "spec"

    fail(gate, 1)
    assert gate.is_open(*M)
    assert await asyncio.wait_for(run.run(M, Budget.lasting(5), metadata, inference=False), 1)
    assert gate.is_open(*M)


def test_succeeded_many_counts_as_that_many_successes_in_the_window() -> None:
    """Nine failures then a batch of 100 successes: the window holds successes only."""
    gate, changes = health()
    fail(gate, 9)
    gate.succeeded_many(M, 100)
    assert fail(gate, 10) == [False] * 10  # 10 of the last 20: not above the rate
    assert not gate.is_open(*M) and changes == []
    assert fail(gate, 1) == [False]  # 11 of 20: trips
    assert gate.is_open(*M)


def test_steps_of_sequences_triton_lost_never_trip_nor_are_held() -> None:
    """After a restart of Triton every live sequence's next step fails (its state is gone):
    those failures say nothing of the release, and a held one could never succeed as a
    probe, so they are dead-lettered whether the breaker is closed or open."""
    gate, changes = health()
    gone = errors.SequenceGone("Triton: must specify the START flag on the first request")
    assert [gate.failed(M, gone, probe=False) for _ in range(50)] == [False] * 50
    assert changes == []
    fail(gate, 10)  # a bad release trips it
    assert changes == [("m", True)]
    assert gate.failed(M, gone, probe=False) is False
    assert gate.failed(M, BAD, probe=False) is True
