"""Steps that must end: each last step of a shutdown gets a bound of its own.

aiokafka retries a commit, a flush or a group leave for as long as the broker is
unreachable; a shutdown must end anyway (its uncommitted records are consumed again).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import structlog

__all__ = ["CLOSE_TIMEOUT_S", "FORCED_CLOSE_TIMEOUT_S", "bounded_step"]

log = structlog.get_logger(__name__)

#: Bound on each last step of a shutdown (the final commit, closing the producer, closing
#: the consumer): an unreachable broker must not keep the process alive. Offsets not
#: committed then are consumed again by the partition's next owner (at-least-once).
CLOSE_TIMEOUT_S = 5.0
#: The same bound once a second signal has asked to exit now.
FORCED_CLOSE_TIMEOUT_S = 1.0


async def bounded_step(step: Awaitable[None], what: str, forced: asyncio.Event) -> None:
    """Await a shutdown step for at most CLOSE_TIMEOUT_S, or until ``forced`` is set.

    aiokafka retries a commit, a flush or a group leave for as long as the broker is
    unreachable: without a bound, SIGTERM (and even a second one) during a broker
    outage would never end the process. A step still running then is cancelled and
    logged; a step that finishes in time returns (or raises) as it would have.
    """
    task = asyncio.ensure_future(step)
    # After a second signal a step still gets a moment: a reachable broker commits
    # what is done in milliseconds, and fewer records are redone.
    forced_already = forced.is_set()
    timeout_s = FORCED_CLOSE_TIMEOUT_S if forced_already else _close_timeout_s()
    forcing = asyncio.ensure_future(forced.wait())
    waiting: set[asyncio.Future[Any]] = {task} if forced_already else {task, forcing}
    try:
        done, _ = await asyncio.wait(
            waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        forcing.cancel()
    if task in done:
        task.result()
        return
    reason = "second signal" if forced.is_set() else f"{timeout_s} s passed"
    log.warning("shutdown_step_abandoned", step=what, reason=reason)
    task.cancel()
    # A client that does not even honour the cancellation is left to the process exit.
    await asyncio.wait({task}, timeout=1.0)


def _close_timeout_s() -> float:
    # Read at call time, so tests can shorten it.
    return CLOSE_TIMEOUT_S
