"""The output topic's size refusals remembered: the smallest refused lately is a ceiling."""

from __future__ import annotations

import pytest

from tests.unit.records.fakes import Clock
from worker.records.refusals import OutputRefusals

pytestmark = pytest.mark.timeout(10)


def test_no_refusal_no_ceiling() -> None:
    assert OutputRefusals(clock=Clock()).ceiling() is None


def test_the_smallest_refused_size_is_the_ceiling() -> None:
    """Refused 90,000 then 70,000 then 80,000 bytes: results of 70,000 bytes or more wait."""
    refusals = OutputRefusals(clock=Clock())
    for size in (90_000, 70_000, 80_000):
        refusals.refused(size)
    assert refusals.ceiling() == 70_000


def test_the_ceiling_is_forgotten_after_the_last_refusal() -> None:
    """Each refusal keeps the ceiling for remember_s more; then any size is tried again
    (the topic's limit may have been raised)."""
    clock = Clock()
    refusals = OutputRefusals(remember_s=60, clock=clock)
    refusals.refused(70_000)
    clock.now += 50
    refusals.refused(75_000)
    clock.now += 50  # 100 s after the first refusal, 50 s after the last
    assert refusals.ceiling() == 70_000
    clock.now += 11
    assert refusals.ceiling() is None
    refusals.refused(90_000)
    assert refusals.ceiling() == 90_000
