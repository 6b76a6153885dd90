"""The drain measurement's throughput from its samples of the results counter."""

from __future__ import annotations

import pytest

from devtools.bench.extras import _slope


def test_slope_runs_from_the_first_sample_with_results_to_the_last() -> None:
    """Start-up samples (no results yet) are left out."""
    points = [(0.5, 0, 80.0), (1.0, 0, 80.0), (1.5, 100, 81.0), (2.5, 1100, 82.0)]
    assert _slope(points) == pytest.approx(1000 / 1.0)


def test_a_drain_done_within_one_sample_is_timed_from_the_sample_before() -> None:
    """One sample with results: rate from the previous (empty) sample, else from the start."""
    assert _slope([(0.5, 0, 80.0), (1.0, 200, 81.0)]) == pytest.approx(200 / 0.5)
    assert _slope([(0.8, 200, 80.0)]) == pytest.approx(200 / 0.8)  # done before any sample
    assert _slope([(0.5, 0, 80.0)]) == 0.0
