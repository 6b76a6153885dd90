"""Labelled metrics whose label values are known in advance have a series from the start."""

from __future__ import annotations

from worker.errors import ERROR_CODES, RETRY_REASONS
from worker.observability import Metrics


def test_retries_and_dead_letters_start_at_zero_for_every_known_reason_and_code() -> None:
    """A fresh worker exports worker_retries_total per retry reason, dead letters per code, at 0."""
    metrics = Metrics(version="test")
    get = metrics.registry.get_sample_value
    assert RETRY_REASONS and ERROR_CODES
    assert [get("worker_retries_total", {"reason": r}) for r in RETRY_REASONS] == [0.0] * len(
        RETRY_REASONS
    )
    assert [get("worker_dead_letters_total", {"code": c}) for c in ERROR_CODES] == [0.0] * len(
        ERROR_CODES
    )


def test_a_models_breaker_gauge_is_zero_from_its_first_record() -> None:
    """The first time a model is seen, worker_model_breaker_open{model} is 0, not absent."""
    metrics = Metrics(version="test")
    get = metrics.registry.get_sample_value
    assert get("worker_model_breaker_open", {"model": "double"}) is None
    assert metrics.model_label("double") == "double"
    assert get("worker_model_breaker_open", {"model": "double"}) == 0.0
    metrics.model_breaker_changed("double", is_open=True)
    assert get("worker_model_breaker_open", {"model": "double"}) == 1.0
    assert metrics.model_label("double") == "double"
    assert get("worker_model_breaker_open", {"model": "double"}) == 1.0
