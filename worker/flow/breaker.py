"""Circuit breaker for Triton outages: stop taking work, keep records in Kafka, resume by itself.

(The Schema Registry has one of its own, named ``registry``: while it is open the records
that need a schema wait for it; see ``worker.registry.writers``.)

Closed: records flow. Consecutive outage failures (Triton unreachable, streams
broken) past a threshold open it. Open: the intake pauses every partition (the
member stays in its group), records already in flight wait for it to close
instead of spending their retries, nothing is dead-lettered for the outage. A
health probe closes it as soon as Triton answers ready again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger(__name__)


class CircuitBreaker:
    """Counts consecutive outage failures; opens past ``failure_threshold``."""

    def __init__(
        self,
        failure_threshold: int,
        on_change: Callable[[bool], None] | None = None,
        name: str = "triton",
    ) -> None:
        """``name``: what it guards, in its log events."""
        self.name = name
        self._threshold = failure_threshold
        self._on_change = on_change
        self._failures = 0
        self._closed = asyncio.Event()
        self._closed.set()
        self._opened = asyncio.Event()
        self.opened_at: float | None = None

    @property
    def is_open(self) -> bool:
        return not self._closed.is_set()

    def record_success(self) -> None:
        self._failures = 0

    def record_failure(self) -> None:
        """One more outage failure; opens the breaker at the threshold."""
        self._failures += 1
        if self._failures >= self._threshold and not self.is_open:
            self.open()

    def open(self) -> None:
        if self.is_open:
            return
        self._closed.clear()
        self._opened.set()
        self.opened_at = time.monotonic()
        log.warning("circuit_open", breaker=self.name, consecutive_failures=self._failures)
        if self._on_change is not None:
            self._on_change(True)

    def close(self) -> None:
        if not self.is_open:
            return
        outage_s = time.monotonic() - (self.opened_at or time.monotonic())
        self._failures = 0
        self._opened.clear()
        self._closed.set()
        log.info("circuit_closed", breaker=self.name, outage_s=round(outage_s, 3))
        if self._on_change is not None:
            self._on_change(False)

    async def wait_open(self) -> None:
        """Wait until the breaker opens (for tests and operators' tooling)."""
        await self._opened.wait()

    async def wait_closed(self) -> float:
        """Wait until closed; return the seconds waited (0 when already closed)."""
        if not self.is_open:
            return 0.0
        started = time.monotonic()
        await self._closed.wait()
        return time.monotonic() - started

    async def probe_loop(
        self,
        healthy: Callable[[], Awaitable[bool]],
        interval_s: float,
        report: Callable[[bool, bool], None],
    ) -> None:
        """Probe Triton every ``interval_s``; a good probe closes, failed ones count.

        ``report(triton_up, breaker_open)`` is called after every probe.
        """
        while True:
            ok = await healthy()
            if ok:
                self.record_success()
                self.close()
            else:
                self.record_failure()
            report(ok, self.is_open)
            await asyncio.sleep(interval_s)
