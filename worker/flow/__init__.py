"""Flow control, pure asyncio: the in-flight window, ordering turns, breakers, holds, retries."""

from worker.flow.breaker import CircuitBreaker
from worker.flow.holds import ModelGate
from worker.flow.limiter import AdaptiveLimiter
from worker.flow.model_health import ModelHealth
from worker.flow.ordering import Ticket, Turns
from worker.flow.retry import Backoff, Budget, Retrier, RetryPolicy
from worker.flow.window import Window

__all__ = [
    "AdaptiveLimiter",
    "Backoff",
    "Budget",
    "CircuitBreaker",
    "ModelGate",
    "ModelHealth",
    "Retrier",
    "RetryPolicy",
    "Ticket",
    "Turns",
    "Window",
]
