"""What the worker tells the outside: logs, metrics, health endpoints, records in flight."""

from worker.observability.health import HealthServer, InFlightSnapshot, ReadinessCheck
from worker.observability.inflight import InFlight, InFlightRegistry
from worker.observability.logging import configure_logging, reset_logging
from worker.observability.metrics import (
    MAX_MODEL_LABELS,
    METRICS_SPEC,
    Metrics,
    metrics_reference_markdown,
)

__all__ = [
    "MAX_MODEL_LABELS",
    "METRICS_SPEC",
    "HealthServer",
    "InFlight",
    "InFlightRegistry",
    "InFlightSnapshot",
    "Metrics",
    "ReadinessCheck",
    "configure_logging",
    "metrics_reference_markdown",
    "reset_logging",
]
