"""A stop requested during start-up abandons it: the worker closes what it had and returns.

``Worker.start`` is replaced at the seam by a start-up that never completes: one that
honours cancellation (aiokafka waiting on a broker), and one that does not (a client
call stuck in a thread), which a real broker cannot be made to do on cue.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import structlog

from worker.app import Worker
from worker.flow import bounded
from worker.flow.bounded import FORCED_CLOSE_TIMEOUT_S
from worker.settings import load_settings

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]

_ENV = {
    "WORKER_INPUT_TOPICS": "in",
    "WORKER_OUTPUT_TOPIC": "out",
    "WORKER_DLQ_TOPIC": "dlq",
    "WORKER_METRICS_PORT": "0",
}


class _HangingStart:
    """A start-up that never completes; ``stubborn`` ones ignore cancellation until released."""

    def __init__(self, *, stubborn: bool) -> None:
        self.stubborn = stubborn
        self.entered = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.released = asyncio.Event()

    async def __call__(self) -> None:
        self.entered.set()
        while True:
            try:
                await self.released.wait()
                return
            except asyncio.CancelledError:
                self.cancelled.set()
                if not self.stubborn:
                    raise


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    """A worker on unused addresses; nothing of it is started but what a test starts."""
    built = Worker(load_settings(_ENV))
    yield built
    await built.stop()


async def _running(worker: Worker, start: _HangingStart) -> asyncio.Task[None]:
    worker.start = start  # type: ignore[method-assign]
    task = asyncio.create_task(worker.run())
    await start.entered.wait()
    return task


async def test_a_stop_during_start_up_abandons_it(worker: Worker) -> None:
    """request_stop while start() waits: start is cancelled, run returns, nothing abandoned."""
    start = _HangingStart(stubborn=False)
    with structlog.testing.capture_logs() as logs:
        task = await _running(worker, start)
        worker.request_stop()
        await asyncio.wait_for(task, 2)
    assert start.cancelled.is_set()
    assert not worker.started.is_set()
    assert not worker.abandoned  # no record was taken: a clean exit
    events = [e["event"] for e in logs]
    assert events.index("startup_abandoned") < events.index("worker_stopped")


async def test_a_start_up_that_ignores_cancellation_is_left_after_the_bound(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start-up deaf to cancellation holds the first stop for CLOSE_TIMEOUT_S at most."""
    monkeypatch.setattr(bounded, "CLOSE_TIMEOUT_S", 0.2)
    monkeypatch.setattr("worker.app.CLOSE_TIMEOUT_S", 0.2)
    start = _HangingStart(stubborn=True)
    task = await _running(worker, start)
    worker.request_stop()
    await asyncio.wait_for(task, 2)
    start.released.set()  # the test's own end: the stuck call returns at last


async def test_a_second_stop_ends_a_stuck_start_up_within_the_forced_budget(
    worker: Worker,
) -> None:
    """A start-up deaf to cancellation: after force_stop, run returns within the budget."""
    start = _HangingStart(stubborn=True)
    task = await _running(worker, start)
    worker.request_stop()
    await start.cancelled.wait()  # the first stop now waits on the stuck start-up
    assert not task.done()
    worker.force_stop()
    await asyncio.wait_for(task, FORCED_CLOSE_TIMEOUT_S + 0.5)
    assert worker.abandoned
    start.released.set()


async def test_a_record_that_outlives_its_cancellation_is_cancelled_again(worker: Worker) -> None:
    """A record whose cancellation was lost goes on waiting (say, for an ack from a broker
    that does not answer): the shutdown cancels it again instead of waiting for it."""
    waiting, swallowed = asyncio.Event(), asyncio.Event()

    async def deaf_once() -> None:
        waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.set()  # lost, as asyncio.wait_for on Python 3.11 can lose it
        await asyncio.Event().wait()

    task = asyncio.create_task(deaf_once())
    worker.dispatcher.running.add(task)
    task.add_done_callback(worker.dispatcher.running.discard)
    await waiting.wait()
    task.cancel()  # what the drain's cancel_all does
    await asyncio.wait_for(worker._cancelled_records_end(), 2)
    assert swallowed.is_set()
    assert task.cancelled()
