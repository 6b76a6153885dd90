"""Shutdown is bounded: a stuck client never keeps the worker; a second signal ends the process.

The stuck step is a coroutine that never returns: it stands in for aiokafka retrying a
commit, a flush or a group leave while the broker is down, which
tests/fault/test_kafka_faults.py reproduces with a real broker, end to end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog

from worker import shutdown
from worker.errors import ExitCode
from worker.flow import bounded as app
from worker.flow.bounded import FORCED_CLOSE_TIMEOUT_S, Forced, bounded_step

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

PROJECT_ROOT = Path(__file__).resolve().parents[2]


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
    monkeypatch.setattr(app, "CLOSE_TIMEOUT_S", 0.05)
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
        await asyncio.wait_for(closing, app.CLOSE_TIMEOUT_S / 2)
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


class _Target:
    """What the signals act on, recording the calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.stopping = asyncio.Event()

    def request_stop(self) -> None:
        self.calls.append("request_stop")
        self.stopping.set()

    def force_stop(self) -> None:
        self.calls.append("force_stop")


async def test_the_first_signal_stops_the_second_forces_and_arms_the_watchdog(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM: request_stop; SIGINT next: force_stop, then the watchdog's exit, code 1."""
    monkeypatch.setattr(shutdown, "WATCHDOG_S", 0.05)
    target, exits = _Target(), asyncio.Queue[tuple[int, str]]()
    loop = asyncio.get_running_loop()
    signals = shutdown.TwoStageSignals(
        target,
        exit_process=lambda code, why: loop.call_soon_threadsafe(exits.put_nowait, (code, why)),
    )
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(target.stopping.wait(), 5)
        assert target.calls == ["request_stop"]
        os.kill(os.getpid(), signal.SIGINT)
        assert await asyncio.wait_for(exits.get(), 5) == (ExitCode.FORCED, "watchdog")
        assert target.calls == ["request_stop", "force_stop"]
        assert signals.received == 2
    finally:
        signals.uninstall()
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def test_the_watchdog_ends_a_process_the_shutdown_cannot_end() -> None:
    """A process whose forced stop never finishes still exits 1 within FORCED_EXIT_S."""
    code = (
        "import asyncio, sys\n"
        "from worker.shutdown import TwoStageSignals\n"
        "class Deaf:\n"
        "    def request_stop(self): print('stopping', flush=True)\n"
        "    def force_stop(self): pass\n"
        "async def main():\n"
        "    TwoStageSignals(Deaf()).install()\n"
        "    print('ready', flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=PROJECT_ROOT
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        while proc.stdout.readline().strip() != "stopping":  # past the log line before it
            assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert proc.wait(shutdown.FORCED_EXIT_S + 10) == ExitCode.FORCED
        assert time.monotonic() - signalled <= shutdown.FORCED_EXIT_S
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_ctrl_c_ends_a_command_whose_work_lost_the_first_cancellation() -> None:
    """Ctrl-C while a command's work swallows one cancellation: it is cancelled again, at once."""

    async def stubborn() -> str:
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, os.kill, os.getpid(), signal.SIGINT)
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            pass  # as asyncio.wait_for (3.11) does when its awaitable completes meanwhile
        await asyncio.sleep(5)
        return "went on"

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        shutdown.run_interruptible(stubborn())
    assert time.monotonic() - started < 2 * shutdown.RECANCEL_S + 1.0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
