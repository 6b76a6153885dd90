"""/readyz's answer from the worker's parts: what makes it unready, and what is only listed."""

from __future__ import annotations

from typing import TypedDict

from worker.observability.readiness import readiness_of


class _Parts(TypedDict):
    consumer_running: bool
    triton_up: bool
    breaker_open: bool


def test_ready_when_consuming_with_triton_up_and_the_breaker_closed() -> None:
    """The plain case: ready, and the detail names each part's state."""
    ready, detail = readiness_of(consumer_running=True, triton_up=True, breaker_open=False)
    assert ready
    assert detail == {"consumer": "running", "triton": "up", "breaker": "closed"}


def test_each_part_down_makes_the_worker_unready() -> None:
    """Consumer stopped, Triton down, breaker open, a partition not ready: each alone is 503."""
    cases: list[_Parts] = [
        {"consumer_running": False, "triton_up": True, "breaker_open": False},
        {"consumer_running": True, "triton_up": False, "breaker_open": False},
        {"consumer_running": True, "triton_up": True, "breaker_open": True},
    ]
    for case in cases:
        assert not readiness_of(**case)[0], case
    ready, detail = readiness_of(
        consumer_running=True, triton_up=True, breaker_open=False, partitions_not_ready=["t-0"]
    )
    assert not ready
    assert detail["partitions_not_ready"] == ["t-0"]


def test_models_held_or_failing_are_listed_but_leave_the_worker_ready() -> None:
    """Other models keep flowing: a model reloading or failing is detail, not unreadiness."""
    ready, detail = readiness_of(
        consumer_running=True,
        triton_up=True,
        breaker_open=False,
        models_not_ready=["mlp"],
        models_failing=["bad:2"],
    )
    assert ready
    assert detail["models_not_ready"] == ["mlp"]
    assert detail["models_failing"] == ["bad:2"]
