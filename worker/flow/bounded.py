"""Steps that must end: each last step of a shutdown gets a bound of its own.

aiokafka retries a commit, a flush or a group leave for as long as the broker is
unreachable; a shutdown must end anyway (its uncommitted records are consumed again).
After a second signal the steps still to run share one short budget, so that the
process ends within ``FORCED_EXIT_S`` of that signal (``worker.shutdown``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import structlog

__all__ = [
    "CLOSE_TIMEOUT_S",
    "FORCED_CLOSE_TIMEOUT_S",
    "Forced",
    "abandon",
    "bounded_step",
    "within",
]

log = structlog.get_logger(__name__)

#: Bound on each last step of a shutdown (the final commit, closing the producer, closing
#: the consumer): an unreachable broker must not keep the process alive. Offsets not
#: committed then are consumed again by the partition's next owner (at-least-once).
CLOSE_TIMEOUT_S = 5.0
#: Once a second signal has asked to exit now, what is left of the shutdown shares this
#: budget, counted from that signal (whatever step it finds running).
FORCED_CLOSE_TIMEOUT_S = 1.0


class Forced:
    """Set by a second signal; from then on the shutdown's last steps share one budget."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._deadline: float | None = None

    def set(self) -> None:
        """Exit now: the steps still to run get what is left of FORCED_CLOSE_TIMEOUT_S."""
        if self._deadline is None:
            self._deadline = time.monotonic() + FORCED_CLOSE_TIMEOUT_S
        self._event.set()

    def is_set(self) -> bool:
        """True once a second signal came."""
        return self._event.is_set()

    async def wait(self) -> None:
        """Return once a second signal came."""
        await self._event.wait()

    def remaining_s(self) -> float:
        """Seconds left of the shared budget (0 when spent; CLOSE_TIMEOUT_S while unforced)."""
        if self._deadline is None:
            return _close_timeout_s()
        return max(0.0, self._deadline - time.monotonic())


async def within(waiting: Awaitable[Any], forced: Forced, timeout_s: float | None) -> bool:
    """Await ``waiting`` for at most ``timeout_s`` (None: no bound), less once forced.

    True when it finished in time; False when the bound or the forced budget ran out
    first: it is then cancelled, without waiting for the cancellation to complete.
    """
    task = asyncio.ensure_future(waiting)
    forcing = asyncio.ensure_future(forced.wait())
    try:
        done, _ = await asyncio.wait(
            {task, forcing}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if task not in done and forcing in done:
            # A second signal came while waiting: what is left of its budget still counts.
            done, _ = await asyncio.wait({task}, timeout=forced.remaining_s())
    finally:
        forcing.cancel()
    if task in done:
        return True
    task.cancel()
    abandon(task)
    return False


def abandon(task: asyncio.Future[Any]) -> None:
    """Give up on ``task``: how it ends is nobody's concern, and its exception is not
    logged as never retrieved when it is collected (a gathering of records given up ends
    with their CancelledError set as its exception)."""
    task.add_done_callback(_disregard)


def _disregard(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def bounded_step(
    step: Awaitable[None],
    what: str,
    forced: Forced,
    *,
    unbounded: bool = False,
) -> None:
    """Await a shutdown step for at most CLOSE_TIMEOUT_S (``unbounded``: until forced).

    aiokafka retries a commit, a flush or a group leave for as long as the broker is
    unreachable: without a bound, SIGTERM (and even a second one) during a broker
    outage would never end the process. A step still running then is cancelled and
    logged; a step that finishes in time returns (or raises) as it would have.
    After a second signal a step still gets what is left of FORCED_CLOSE_TIMEOUT_S:
    a reachable broker commits what is done in milliseconds, and fewer records are redone.
    """
    task = asyncio.ensure_future(step)
    if forced.is_set():
        bound_s: float | None = forced.remaining_s()
    else:
        bound_s = None if unbounded else _close_timeout_s()
    if await within(task, forced, bound_s):
        task.result()
        return
    reason = "second signal" if forced.is_set() else f"{bound_s} s passed"
    log.warning("shutdown_step_abandoned", step=what, reason=reason)
    # A client that does not even honour the cancellation is left to the process exit.
    await asyncio.wait({task}, timeout=min(1.0, forced.remaining_s()))


def _close_timeout_s() -> float:
    # Read at call time, so tests can shorten it.
    return CLOSE_TIMEOUT_S
