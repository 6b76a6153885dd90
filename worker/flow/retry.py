"""Retries, once: exponential backoff with full jitter, a record's deadline budget, the loop.

Every retry loop of the worker (a record's inference, a Kafka write, re-opening a
Triton stream) waits with a ``Backoff``; a record's tries share one ``Budget``; a
record's calls to Triton are retried by one ``Retrier``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from worker import errors
from worker.flow.breaker import CircuitBreaker
from worker.flow.holds import ModelGate
from worker.flow.model_health import ModelHealth
from worker.observability.inflight import DETACHED, InFlight

__all__ = ["Backoff", "Budget", "Retrier", "RetryPolicy"]

_T = TypeVar("_T")


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
    """One monotonic deadline per record, shared by all its tries; failures counted.

    ``entry`` is the record's in-flight entry: the tries write where the record is.
    """

    deadline: float
    failures: int = 0
    entry: InFlight = DETACHED

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


class Retrier:
    """Runs a record's calls to Triton: retryable failures retried, outages waited out."""

    def __init__(
        self,
        policy: RetryPolicy,
        breaker: CircuitBreaker,
        models: ModelGate | None,
        on_retry: Callable[[str], None],
        health: ModelHealth | None = None,
        *,
        on_success: Callable[[tuple[str, str] | None, bool], None],
    ) -> None:
        """``on_retry(code)`` is told of each retry, by the code of the failure;
        ``on_success(model, probe)`` of each call that succeeded, with its model when the
        call's outcome is one of the model's (an inference, with ``health``) and whether
        it was that model's probe (``worker.records.steps`` keeps the books)."""
        self.policy = policy
        self._breaker = breaker
        self._models = models
        self._on_retry = on_retry
        self._on_success = on_success
        self._health = health

    async def run(
        self,
        model: tuple[str, str],
        budget: Budget,
        call: Callable[[float], Awaitable[_T]],
        *,
        inference: bool = True,
    ) -> _T:
        """Call with the remaining time; retry retryable failures with full-jitter backoff.

        An outage (Triton unreachable) is not the record's fault: it feeds the
        circuit breaker, never counts as a try, and while the breaker is open
        the record waits for it to close with its deadline paused; a failover (its
        endpoint lost, another up) is sent again at once. A model
        being (re)loaded is an outage of that model: the record waits for it
        the same way (see ModelGate). ``inference``: the call's outcome is one of
        the model's, counted by its failure-rate breaker; while that is open the
        record waits for its turn to probe or for the breaker to close (see
        ModelHealth). ``model`` is (name, version).
        """
        models, policy, entry = self._models, self.policy, budget.entry
        health = self._health if inference else None
        while True:
            if models is not None and models.is_held(*model):
                entry.state = "held_model"
                budget.pause(await models.wait_ready(*model))
            probe = False
            if health is not None:
                # Set and reset with no await between them while the model's breaker is closed.
                entry.state = "held_failing"
                waited_s, probe = await health.admit(model)
                budget.pause(waited_s)
            entry.state = "sent"
            try:
                result = await call(max(0.001, budget.remaining_s()))
            except errors.WorkerError as error:
                if health is not None and health.failed(model, error, probe):
                    continue  # the model fails at a rate: held, not the record's fault
                if await self._held(model, error):
                    continue
                if not error.retryable:
                    raise
                if isinstance(error, errors.TritonUnavailable):
                    await self._unreachable(error, budget)
                    continue
                budget.failures += 1
                backoff_s = policy.backoff.delay_s(budget.failures)
                if budget.failures >= policy.max_attempts or backoff_s >= budget.remaining_s():
                    raise errors.RetriesExhausted.after(error, budget.failures) from error
                self._on_retry(error.code)
                await self._wait(entry, budget, backoff_s)
            except BaseException:
                if health is not None:
                    health.abandoned(model, probe)
                raise
            else:
                self._on_success(model if health is not None else None, probe)
                return result

    async def _unreachable(self, error: errors.TritonUnavailable, budget: Budget) -> None:
        """Not a try: Triton, or only the request's endpoint, could not be reached.

        An endpoint lost while another serves (TritonFailover) is neither an outage nor
        the record's fault: the call goes again at once. An outage feeds the breaker;
        the record waits for it to close when it opens, else as after a first failure.
        """
        failover = isinstance(error, errors.TritonFailover)
        if not failover:
            self._breaker.record_failure()
            if self._breaker.is_open:
                budget.entry.state = "held_outage"
                budget.pause(await self._breaker.wait_closed())
                return
        if budget.remaining_s() <= 0:
            raise errors.RetriesExhausted.after(error, budget.failures + 1) from error
        self._on_retry(error.code)
        if not failover:
            await self._wait(budget.entry, budget, self.policy.backoff.delay_s(1))

    @staticmethod
    async def _wait(entry: InFlight, budget: Budget, seconds: float) -> None:
        """Sleep until the next try, the record marked retrying meanwhile."""
        entry.state, entry.attempt = "retrying", budget.failures + 1
        entry.next_try_at = time.monotonic() + seconds
        await asyncio.sleep(seconds)

    async def _held(self, model: tuple[str, str], error: errors.WorkerError) -> bool:
        """True when ``error`` means the model is being (re)loaded: the record should wait."""
        if self._models is None or not isinstance(
            error, (errors.ModelNotReady, errors.ModelNotFound)
        ):
            return False
        return await self._models.should_hold(*model)
