"""What ``/readyz`` answers: ready or not, and the detail of what is (not) ready."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["readiness_of"]


def readiness_of(
    *,
    consumer_running: bool,
    triton_up: bool,
    breaker_open: bool,
    models_not_ready: Sequence[str] = (),
    models_failing: Sequence[str] = (),
    partitions_not_ready: Sequence[str] = (),
) -> tuple[bool, dict[str, object]]:
    """Ready when the consumer runs, Triton is reachable, the breaker is closed and every
    assigned partition can be done (``exactly_once``: its transactional producer started).

    Models held (being reloaded) or failing (their failure-rate breaker open) are listed
    but do not make the worker unready: the other models keep flowing.
    """
    detail: dict[str, object] = {
        "consumer": "running" if consumer_running else "stopped",
        "triton": "up" if triton_up else "down",
        "breaker": "open" if breaker_open else "closed",
    }
    if models_not_ready:
        detail["models_not_ready"] = list(models_not_ready)
    if models_failing:
        detail["models_failing"] = list(models_failing)
    if partitions_not_ready:
        detail["partitions_not_ready"] = list(partitions_not_ready)
    ready = consumer_running and triton_up and not breaker_open and not partitions_not_ready
    return ready, detail
