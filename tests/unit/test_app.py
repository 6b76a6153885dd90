"""The worker: built in order, connected when it runs, stopped once; a stop during start-up.

``Worker.start`` is replaced at the seam by a start-up that never completes: one that
honours cancellation (aiokafka waiting on a broker), and one that does not (a client
call stuck in a thread), which a real broker cannot be made to do on cue. Where a test
runs the worker, its intake is a fake that records what it is given and fetches nothing.
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
from typing import Any

import pytest
import structlog
from aiokafka.structs import ConsumerRecord

from tests.unit.conftest import MakeWorker
from worker import app
from worker.app import GC_YOUNG_THRESHOLD, Worker, run_async
from worker.flow import bounded
from worker.flow.bounded import FORCED_CLOSE_TIMEOUT_S

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]


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


async def _running(worker: Worker, start: _HangingStart) -> asyncio.Task[None]:
    worker.start = start  # type: ignore[method-assign]
    task = asyncio.create_task(worker.run())
    await start.entered.wait()
    return task


async def test_a_stop_during_start_up_abandons_it(make_worker: MakeWorker) -> None:
    """request_stop while start() waits: start is cancelled, run returns, nothing abandoned."""
    worker = make_worker()
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
    make_worker: MakeWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start-up deaf to cancellation holds the first stop for CLOSE_TIMEOUT_S at most."""
    worker = make_worker()
    monkeypatch.setattr(bounded, "CLOSE_TIMEOUT_S", 0.2)
    monkeypatch.setattr("worker.app.CLOSE_TIMEOUT_S", 0.2)
    start = _HangingStart(stubborn=True)
    task = await _running(worker, start)
    worker.request_stop()
    await asyncio.wait_for(task, 2)
    start.released.set()  # the test's own end: the stuck call returns at last


async def test_a_second_stop_ends_a_stuck_start_up_within_the_forced_budget(
    make_worker: MakeWorker,
) -> None:
    """A start-up deaf to cancellation: after force_stop, run returns within the budget."""
    worker = make_worker()
    start = _HangingStart(stubborn=True)
    task = await _running(worker, start)
    worker.request_stop()
    await start.cancelled.wait()  # the first stop now waits on the stuck start-up
    assert not task.done()
    worker.force_stop()
    await asyncio.wait_for(task, FORCED_CLOSE_TIMEOUT_S + 0.5)
    assert worker.abandoned
    start.released.set()


async def test_a_record_that_outlives_its_cancellation_is_cancelled_again(
    make_worker: MakeWorker,
) -> None:
    """A record whose cancellation was lost goes on waiting (say, for an ack from a broker
    that does not answer): the shutdown cancels it again instead of waiting for it."""
    worker = make_worker()
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


class _Intake:
    """The intake's seam: records what ``run`` is given; runs until ``request_stop``."""

    running = False

    def __init__(self) -> None:
        self.given: tuple[Any, Any] | None = None
        self.fetching = asyncio.Event()
        self._stop = asyncio.Event()
        self.stopped = 0

    async def run(self, dispatch: Any, admits: Any) -> None:
        self.given = (dispatch, admits)
        self.fetching.set()
        await self._stop.wait()

    def request_stop(self) -> None:
        self._stop.set()

    async def stop(self) -> None:
        self.stopped += 1


async def _nothing() -> None:
    """A start-up with nothing to connect to."""


async def test_running_connects_the_intake_to_the_dispatcher_and_the_delivery_mode(
    make_worker: MakeWorker,
) -> None:
    """run: the intake dispatches through the dispatcher (into the run's task group) and
    asks the delivery mode what it admits; nothing of it was set before."""
    worker = make_worker()
    real, intake = worker.intake, _Intake()
    worker.intake = intake  # type: ignore[assignment]
    worker.start = _nothing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="before the worker runs"):
        worker.dispatcher.dispatch_many([_record()])
    task = asyncio.create_task(worker.run())
    await intake.fetching.wait()
    assert intake.given is not None
    dispatch, admits = intake.given
    assert dispatch == worker.dispatcher.dispatch_many
    assert admits == worker.delivery.admits
    dispatch([])  # dispatching works now: the task group is the run's
    worker.request_stop()
    await asyncio.wait_for(task, 5)
    assert intake.stopped == 1 and not worker.abandoned
    await real.stop()  # the consumer the fake stood in for


@pytest.mark.parametrize(
    ("settings", "batch_path"),
    [
        pytest.param({}, True, id="at_least_once"),
        pytest.param({"delivery": "exactly_once"}, True, id="exactly_once"),
        pytest.param({"ordering": "key"}, True, id="ordered"),
        pytest.param({"audit": "log"}, True, id="audited"),
        pytest.param({"fast_path": "false"}, False, id="off"),
    ],
)
async def test_the_group_path_is_built_in_every_mode(
    make_worker: MakeWorker, settings: dict[str, str], batch_path: bool
) -> None:
    """The dispatcher gets the group path whatever the delivery mode, ordering or audit;
    only WORKER_FAST_PATH=false leaves it out."""
    worker = make_worker(**settings)
    assert (worker.dispatcher.batch is not None) is batch_path


async def test_stop_closes_once(make_worker: MakeWorker) -> None:
    """stop twice: the second does nothing (one worker_stopped line)."""
    worker = make_worker()
    with structlog.testing.capture_logs() as logs:
        await worker.stop()
        await worker.stop()
    assert [e["event"] for e in logs].count("worker_stopped") == 1


def _record() -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord("in", 0, 0, 0, 0, None, b"{}", None, 0, 2, [])


async def _answer() -> int:
    return 7


def test_run_async_returns_the_exit_code_and_collects_the_young_generation_often() -> None:
    """A threshold above 700 (Python 3.13's 2,000) is lowered; the older ones are kept."""
    saved = gc.get_threshold()
    try:
        gc.set_threshold(2000, 11, 12)
        assert run_async(_answer()) == 7
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, 11, 12)
        gc.set_threshold(500, 10, 10)
        run_async(_answer())
        assert gc.get_threshold() == (500, 10, 10)  # already more often: left alone
    finally:
        gc.set_threshold(*saved)


async def test_a_worker_serving_its_process_freezes_the_heap_once_started(
    make_worker: MakeWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``freezes_heap`` (the process's worker, as ``serve`` builds it): the heap is
    frozen once, after start-up and before the intake fetches; a worker built without it
    (tests, embedders) leaves the collector alone."""
    events: list[str] = []

    def frozen() -> int:
        events.append("frozen")
        return 1

    monkeypatch.setattr(app, "freeze_heap", frozen)

    async def started() -> None:
        events.append("started")

    for freeze in (True, False):
        events.clear()
        worker = make_worker()
        worker.freezes_heap = freeze
        real, intake = worker.intake, _Intake()
        worker.intake = intake  # type: ignore[assignment]
        worker.start = started  # type: ignore[method-assign]
        task = asyncio.create_task(worker.run())
        await intake.fetching.wait()
        events.append("fetching")
        worker.request_stop()
        await asyncio.wait_for(task, 5)
        await real.stop()
        expected = ["started", "frozen", "fetching"] if freeze else ["started", "fetching"]
        assert events == expected


#: In a fresh interpreter: a reference cycle dropped, another kept, then the heap frozen.
_FREEZE_PROBE = """
import gc, weakref
from worker.app import freeze_heap
class Node:
    pass
dropped = Node(); dropped.me = dropped; dropped_ref = weakref.ref(dropped); del dropped
kept = Node(); kept.me = kept; kept_ref = weakref.ref(kept)
frozen = freeze_heap()
print(dropped_ref() is None, frozen > 1000, frozen == gc.get_freeze_count())
del kept
gc.collect()
print(kept_ref() is not None)
"""


def test_freezing_the_heap_collects_its_garbage_first_then_leaves_the_rest_out() -> None:
    """A cycle already garbage is collected, not frozen; every object alive is frozen (one
    dropped in a cycle afterwards stays: start-up objects live as long as the process)."""
    done = subprocess.run(
        [sys.executable, "-c", _FREEZE_PROBE], capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["True", "True", "True", "True"]
