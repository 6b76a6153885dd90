"""Backoff with full jitter, and the deadline budget a record's tries share."""

from __future__ import annotations

import random

import pytest

from worker.flow.retry import Backoff, Budget

pytestmark = pytest.mark.timeout(10)


def test_the_cap_doubles_per_failure_up_to_the_maximum() -> None:
    """first, 2x, 4x ... never above max."""
    backoff = Backoff(first_s=0.1, max_s=0.5)
    assert [backoff.cap_s(n) for n in range(1, 6)] == [0.1, 0.2, 0.4, 0.5, 0.5]


def test_waits_are_drawn_below_the_cap() -> None:
    """Full jitter: every wait is in [0, cap); they differ (workers do not retry together)."""
    random.seed(7)
    backoff = Backoff(first_s=1.0, max_s=8.0)
    waits = [backoff.delay_s(3) for _ in range(200)]
    assert all(0 <= w <= 4.0 for w in waits)
    assert len(set(waits)) > 150 and max(waits) > 3.0 and min(waits) < 1.0


def test_a_paused_budget_gives_the_waiting_time_back() -> None:
    """Time spent waiting for an outage to end is not taken from the record."""
    budget = Budget.lasting(10.0)
    before = budget.remaining_s()
    budget.pause(5.0)
    assert 14.0 < budget.remaining_s() <= before + 5.0
