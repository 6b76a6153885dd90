"""Retry timing, once: exponential backoff with full jitter, and a record's deadline budget.

Every retry loop of the worker (a record's inference, a Kafka write, re-opening a
Triton stream) waits with a ``Backoff``; a record's tries share one ``Budget``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

__all__ = ["Backoff", "Budget", "RetryPolicy"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """After the n-th failure wait uniformly in [0, min(max_s, first_s * 2**n)) ("full jitter").

    Jitter keeps many workers that failed together from retrying together.
    """

    first_s: float
    max_s: float

    def cap_s(self, failures: int) -> float:
        """The longest wait after ``failures`` failures (>= 1)."""
        return min(self.max_s, self.first_s * float(2 ** max(0, failures - 1)))

    def delay_s(self, failures: int) -> float:
        """A wait after ``failures`` failures, drawn with full jitter."""
        return random.uniform(0, self.cap_s(failures))


@dataclass(slots=True)
class Budget:
    """One monotonic deadline per record, shared by all its tries; failures counted."""

    deadline: float
    failures: int = 0

    @classmethod
    def lasting(cls, seconds: float) -> Budget:
        """A budget ending ``seconds`` from now."""
        return cls(time.monotonic() + seconds)

    def remaining_s(self) -> float:
        """Seconds left (negative once spent)."""
        return self.deadline - time.monotonic()

    def pause(self, seconds: float) -> None:
        """Give back time the record spent waiting for something that was not its fault."""
        self.deadline += seconds


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a record's retryable failures are retried."""

    max_attempts: int
    backoff: Backoff
    record_deadline_s: float  # all tries of a record
    try_timeout_s: float  # one try on a Triton stream
