"""Two-stage signals: the first stops the worker, the second forces it and ends the process.

The steps of a shutdown and their bounds are tested in tests/unit/flow/test_bounded.py.
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

from worker import shutdown
from worker.errors import ExitCode

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

PROJECT_ROOT = Path(__file__).resolve().parents[2]


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

    def exit_process(code: int, why: str) -> None:
        loop.call_soon_threadsafe(exits.put_nowait, (code, why))

    signals = shutdown.TwoStageSignals(target, exit_process=exit_process)
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
