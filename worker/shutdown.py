"""Two-stage signals: the first stops the worker, the second ends the process within 2 s.

The first SIGTERM or SIGINT asks the worker to stop: during start-up the start-up is
abandoned; once running, fetching stops and the records in flight drain within
``WORKER_SHUTDOWN_TIMEOUT_S``. The second abandons what is in flight, and what is left
of the shutdown shares a short budget (``worker.flow.bounded``). A watchdog thread then
ends the process if something still holds it: a librdkafka call stuck on an unreachable
broker, a thread the interpreter would join at exit. The process is gone within
``FORCED_EXIT_S`` of the second signal, whatever it was doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any, NoReturn, Protocol, TypeVar

import structlog

from worker.errors import ExitCode

__all__ = [
    "FORCED_EXIT_S",
    "Stoppable",
    "TwoStageSignals",
    "end_process",
    "run_interruptible",
]

log = structlog.get_logger(__name__)

#: The process ends within this many seconds of a second signal.
FORCED_EXIT_S = 2.0
#: The watchdog fires this long after the second signal: the cooperative shutdown has had
#: its budget (FORCED_CLOSE_TIMEOUT_S), and the exit itself still needs a moment.
WATCHDOG_S = 1.6
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_T = TypeVar("_T")


class Stoppable(Protocol):
    """What the signals act on: a worker."""

    def request_stop(self) -> None: ...

    def force_stop(self) -> None: ...


class TwoStageSignals:
    """SIGTERM and SIGINT on the event loop: the first stops ``target``, the second forces."""

    def __init__(
        self, target: Stoppable, *, exit_process: Callable[[int, str], None] | None = None
    ) -> None:
        """``exit_process(code, why)`` ends the process (by default at once, no cleanup)."""
        self.target = target
        self._exit = exit_process or _exit_now
        #: Signals received so far (the exit code depends on it).
        self.received = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: threading.Timer | None = None

    def install(self) -> None:
        """Handle both signals on the running loop."""
        self._loop = asyncio.get_running_loop()
        for signum in _SIGNALS:
            self._loop.add_signal_handler(signum, self._on_signal, signum)

    def uninstall(self) -> None:
        """Leave the loop; a second signal while the process exits still ends it now."""
        if self._loop is not None:
            for signum in _SIGNALS:
                with contextlib.suppress(Exception):
                    self._loop.remove_signal_handler(signum)
            self._loop = None
        # After the loop, the interpreter may still wait (threads it joins, client handles
        # it destroys): the promise of the second signal holds there too.
        for signum in _SIGNALS:
            signal.signal(signum, self._after_loop)

    def _on_signal(self, signum: int) -> None:
        self.received += 1
        name = signal.Signals(signum).name
        if self.received == 1:
            log.info("shutdown_requested", signal=name)
            self.target.request_stop()
            return
        log.warning("forced_exit", signal=name, within_s=FORCED_EXIT_S)
        self._arm_watchdog()
        self.target.force_stop()

    def _after_loop(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        if self.received >= 2:
            self._exit(ExitCode.FORCED, signal.Signals(signum).name)

    def _arm_watchdog(self) -> None:
        if self._watchdog is not None:
            return
        self._watchdog = threading.Timer(WATCHDOG_S, self._exit, (ExitCode.FORCED, "watchdog"))
        self._watchdog.daemon = True  # a process that ended by itself does not wait for it
        self._watchdog.start()


def _exit_now(code: int, why: str) -> None:
    """End the process at once (no cleanup: the shutdown had its budget)."""
    # Logged from a thread of its own: a stream blocked mid-write must not keep us alive.
    say = threading.Thread(
        target=lambda: log.warning("forced_exit_now", reason=why, exit_code=code), daemon=True
    )
    say.start()
    say.join(0.1)
    os._exit(code)


def end_process(code: int) -> NoReturn:
    """End a process whose worker has stopped, skipping the interpreter's own teardown.

    The worker closed what needs closing (commits, producer flush, spans). The
    teardown that remains would run with the signal handlers back to their defaults
    (a second Ctrl-C then kills the process with SIGINT's status, not exit 1), and
    can block: garbage-collecting a librdkafka handle with the broker unreachable
    waits on its threads.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


#: How often Ctrl-C's cancellation of a command is made again while the command goes on.
RECANCEL_S = 0.2


def run_interruptible(work: Coroutine[Any, Any, _T]) -> _T:
    """``asyncio.run(work)`` for a command other than ``run``: Ctrl-C raises KeyboardInterrupt.

    asyncio's own Ctrl-C handling cancels the work once. On Python 3.11 ``asyncio.wait_for``
    loses a cancellation that arrives as its awaitable completes (a connection accepted as
    the user presses Ctrl-C), and the command then waits out its timeout. Here the work
    is cancelled again every ``RECANCEL_S`` until it ends.
    """
    return asyncio.run(_until_interrupted(work))


async def _until_interrupted(work: Coroutine[Any, Any, _T]) -> _T:
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    interrupted = False

    def cancel() -> None:
        nonlocal interrupted
        interrupted = True
        if not task.done():
            task.cancel()
            loop.call_later(RECANCEL_S, cancel)

    loop.add_signal_handler(signal.SIGINT, cancel)
    try:
        return await task
    except asyncio.CancelledError:
        if interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)
