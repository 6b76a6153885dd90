"""Shutdown steps are bounded: a stuck client never keeps the worker past the bound.

The stuck step is a coroutine that never returns: it stands in for aiokafka retrying a
commit, a flush or a group leave while the broker is down, which
tests/fault/test_kafka_faults.py reproduces with a real broker, end to end.
"""

from __future__ import annotations

import asyncio

import pytest
import structlog

from worker.flow import bounded
from worker.flow.bounded import FORCED_CLOSE_TIMEOUT_S, Forced, bounded_step

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class _Stuck:
    """A shutdown step that never finishes; records that it began and that it was cancelled."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def step(self) -> None:
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_a_stuck_step_is_abandoned_after_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A final commit that never returns is cancelled after CLOSE_TIMEOUT_S, and logged."""
    monkeypatch.setattr(bounded, "CLOSE_TIMEOUT_S", 0.05)
    stuck = _Stuck()
    with structlog.testing.capture_logs() as logs:
        await asyncio.wait_for(bounded_step(stuck.step(), "final_commit", Forced()), 5)
    assert stuck.cancelled.is_set()
    abandoned = [e for e in logs if e["event"] == "shutdown_step_abandoned"]
    assert abandoned == [
        {
            "event": "shutdown_step_abandoned",
            "step": "final_commit",
            "reason": "0.05 s passed",
            "log_level": "warning",
        }
    ]


async def test_a_second_signal_ends_a_stuck_step_at_once() -> None:
    """A second signal while a close waits: the step is abandoned well before CLOSE_TIMEOUT_S."""
    stuck, forced = _Stuck(), Forced()
    with structlog.testing.capture_logs() as logs:
        closing = asyncio.create_task(bounded_step(stuck.step(), "producer_close", forced))
        await stuck.entered.wait()
        forced.set()  # what Worker.force_stop does on the second signal
        await asyncio.wait_for(closing, bounded.CLOSE_TIMEOUT_S / 2)
    assert stuck.cancelled.is_set()
    assert [e["reason"] for e in logs if e["event"] == "shutdown_step_abandoned"] == [
        "second signal"
    ]


async def test_a_step_that_finishes_in_time_keeps_its_outcome() -> None:
    """A step that fails in time raises its own error; one that succeeds logs nothing."""
    forced = Forced()

    async def fails() -> None:
        raise RuntimeError("commit refused")

    async def succeeds() -> None:
        return None

    with structlog.testing.capture_logs() as logs:
        await bounded_step(succeeds(), "consumer_close", forced)
        with pytest.raises(RuntimeError, match="commit refused"):
            await bounded_step(fails(), "final_commit", forced)
    assert logs == []


async def test_after_a_second_signal_a_step_still_gets_a_moment() -> None:
    """Already forced: a quick step (a commit to a reachable broker) still completes."""
    forced = Forced()
    forced.set()
    finished = asyncio.Event()

    async def quick() -> None:
        await asyncio.sleep(0.01)  # a commit's round trip
        finished.set()

    await bounded_step(quick(), "final_commit", forced)
    assert finished.is_set()


async def test_after_a_second_signal_the_steps_left_share_one_budget() -> None:
    """Three stuck steps after a second signal end within one FORCED_CLOSE_TIMEOUT_S, not three."""
    forced = Forced()
    forced.set()
    started = asyncio.get_running_loop().time()
    for what in ("final_commit", "producer_close", "consumer_close"):
        await bounded_step(_Stuck().step(), what, forced)
    took_s = asyncio.get_running_loop().time() - started
    assert took_s < FORCED_CLOSE_TIMEOUT_S + 0.5, took_s


async def test_an_unbounded_step_waits_until_forced() -> None:
    """An unbounded step (Triton's close) outlives CLOSE_TIMEOUT_S; a second signal ends it."""
    stuck, forced = _Stuck(), Forced()
    closing = asyncio.create_task(
        bounded_step(stuck.step(), "triton_close", forced, unbounded=True)
    )
    await stuck.entered.wait()
    done, _ = await asyncio.wait({closing}, timeout=0.2)
    assert not done  # no bound of its own
    forced.set()
    await asyncio.wait_for(closing, FORCED_CLOSE_TIMEOUT_S + 0.5)
    assert stuck.cancelled.is_set()


async def test_a_step_given_up_leaves_no_exception_unretrieved() -> None:
    """A gathering given up at its bound ends with its records' CancelledError as its
    exception (Python 3.11): nothing is logged as never retrieved when it is collected
    (such a log, from a collection inside a compile, broke an unrelated test run)."""
    import gc

    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))

    async def deaf() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0)  # ends a moment after its cancellation
            raise

    records = [asyncio.create_task(deaf())]
    await asyncio.sleep(0)
    gathering = asyncio.gather(*records, return_exceptions=True)
    assert not await bounded.within(gathering, Forced(), 0.01)
    await asyncio.wait(records)
    await asyncio.sleep(0)
    assert gathering.done() and not gathering.cancelled()
    del gathering, records
    gc.collect()
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert reported == []
