"""A breaker per model on its INFERENCE_ERROR rate: a bad release is held, not dead-lettered.

A request that fails with ``INFERENCE_ERROR`` is normally the record's fault (a
poison pill) and is dead-lettered at once. A model version that fails *every*
request would turn the whole topic into dead letters within seconds, so each
model (name, version) keeps its last ``window`` inference outcomes. When at least
``min_samples`` of them are known and more than ``failure_rate`` of them failed,
the model's breaker opens:

- the failures that tripped it (the *sample*) have been dead-lettered already;
  every later ``INFERENCE_ERROR`` of the model, and every record of it that comes
  to be sent, is held instead: it keeps its window slot and offset, its deadline
  is paused, no try is spent (as for a model being reloaded, see ModelGate); the
  held records fill the window and the intake pauses partitions;
- every ``probe_interval_s`` exactly one held record is let through (oldest
  first). Its success closes the breaker and releases the others; its failure
  keeps the breaker open and sends that record to the back of the queue (held
  again, not dead-lettered), so that a poison pill cannot be the probe every time.

Only probes close the breaker: a success of a record sent before the breaker
opened says nothing of the requests that fail. Closing forgets the outcomes
(they belong to the bad release), so the model must show ``min_samples`` new
outcomes before it can trip again. Outcomes other than success or
``INFERENCE_ERROR`` (a timeout, an invalid request) are not counted, nor a step of a
sequence whose state Triton lost (``SequenceGone``: dead-lettered, never held).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from worker import errors

if TYPE_CHECKING:
    from worker.settings import RetrySettings

log = structlog.get_logger(__name__)

__all__ = ["ModelHealth", "Trip"]

_Model = tuple[str, str]  # (name, version); version "" is the latest
#: A waiter's future resolves to True when it is the probe, False when the breaker closed.
_Waiter = asyncio.Future[bool]


@dataclass(frozen=True, slots=True)
class Trip:
    """How a model's breaker opened: ``failures`` of the last ``outcomes`` failed."""

    failures: int
    outcomes: int
    at: float  # monotonic


@dataclass(slots=True)
class _State:
    outcomes: deque[bool]  # True: failed with INFERENCE_ERROR
    failures: int = 0
    trip: Trip | None = None  # set while open
    waiters: deque[_Waiter] = field(default_factory=deque)
    probing: bool = False


class ModelHealth:
    """Per-model INFERENCE_ERROR rate breakers, and the probe loop that closes them."""

    def __init__(
        self,
        *,
        failure_rate: float,
        window: int,
        min_samples: int,
        probe_interval_s: float,
        on_change: Callable[[str, str, bool], None] | None = None,
    ) -> None:
        """``on_change(name, version, is_open)`` is told of every opening and closing.

        A ``failure_rate`` of 1 never trips (no rate is above 1).
        """
        self._rate = failure_rate
        self._window = window
        self._min_samples = min(min_samples, window)
        self._interval_s = probe_interval_s
        self._on_change = on_change
        self._models: dict[_Model, _State] = {}
        self._open: dict[_Model, _State] = {}
        self._changed = asyncio.Event()
        self.last_trip: dict[_Model, Trip] = {}

    @classmethod
    def from_settings(
        cls, retry: RetrySettings, on_change: Callable[[str, str, bool], None] | None = None
    ) -> ModelHealth:
        """The breaker the ``WORKER_MODEL_FAILURE_*`` settings describe."""
        return cls(
            failure_rate=retry.model_failure_rate,
            window=retry.model_failure_window,
            min_samples=retry.model_failure_min_samples,
            probe_interval_s=retry.breaker_probe_interval_ms / 1000,
            on_change=on_change,
        )

    def is_open(self, name: str, version: str) -> bool:
        """True while the model's records are held for its failure rate."""
        return (name, version) in self._open

    def failing(self) -> list[str]:
        """The models whose breaker is open, as ``name`` or ``name:version``, sorted."""
        return sorted(f"{name}:{version}" if version else name for name, version in self._open)

    async def admit(self, model: _Model) -> tuple[float, bool]:
        """Wait while the model's breaker is open; (seconds waited, whether this is the probe).

        Returns at once, (0, False), while the breaker is closed.
        """
        state = self._open.get(model)
        if state is None:
            return 0.0, False
        started = time.monotonic()
        waiter: _Waiter = asyncio.get_running_loop().create_future()
        state.waiters.append(waiter)
        try:
            probe = await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self._probe_ended(model)  # granted the probe, then cancelled: the next one goes
            with contextlib.suppress(ValueError):
                state.waiters.remove(waiter)
            raise
        return time.monotonic() - started, probe

    def succeeded(self, model: _Model, probe: bool) -> None:
        """One inference of the model succeeded; a probe's success closes its breaker."""
        if probe:
            self._probe_ended(model)
            self._close(model)
            return
        if model not in self._open:
            self._observe(model, failed=False)

    def succeeded_many(self, model: _Model, count: int) -> None:
        """``count`` inferences of the model succeeded (not probes): as many ``succeeded``."""
        if model in self._open:
            return
        # Only the last ``window`` outcomes are kept: more successes than that change nothing.
        for _ in range(min(count, self._window)):
            self._observe(model, failed=False)

    def failed(self, model: _Model, error: errors.WorkerError, probe: bool) -> bool:
        """One inference of the model failed with ``error``; True when the record is held.

        Only INFERENCE_ERROR counts, and not a step of a sequence Triton no longer holds
        (its state was lost, most often in a restart of Triton, after which every live
        sequence's next step fails: that says nothing of the release, and holding such a
        step would hold its partition for good, since no probe of it can succeed).
        Held: the breaker was open already (or the record is the probe); not held: the
        model is healthy, or this failure trips the breaker (it is part of the sample).
        Either way a probe has ended.
        """
        if probe:
            self._probe_ended(model)
        if not isinstance(error, errors.InferenceError) or isinstance(error, errors.SequenceGone):
            return False
        if model in self._open:
            return True
        self._observe(model, failed=True)
        return False

    def abandoned(self, model: _Model, probe: bool) -> None:
        """The record left without an outcome (cancelled, or a bug): a probe has ended."""
        if probe:
            self._probe_ended(model)

    async def probe_loop(self) -> None:
        """Every ``probe_interval_s`` while a breaker is open, let one held record through."""
        while True:
            if not self._open:
                self._changed.clear()
                await self._changed.wait()
            await asyncio.sleep(self._interval_s)
            self.probe_once()

    def probe_once(self) -> int:
        """Let one held record of each open model through, unless its probe is in flight.

        Returns how many probes were let through.
        """
        granted = 0
        for state in list(self._open.values()):
            if state.probing:
                continue  # at most one probe in flight per model
            while state.waiters:
                waiter = state.waiters.popleft()
                if not waiter.done():
                    waiter.set_result(True)
                    state.probing = True
                    granted += 1
                    break
        return granted

    # -- state changes -----------------------------------------------------------

    def _observe(self, model: _Model, *, failed: bool) -> None:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _State(deque(maxlen=self._window))
        if len(state.outcomes) == self._window:
            state.failures -= state.outcomes[0]
        state.outcomes.append(failed)
        state.failures += failed
        seen = len(state.outcomes)
        if failed and seen >= self._min_samples and state.failures > self._rate * seen:
            self._trip(model, state, Trip(state.failures, seen, time.monotonic()))

    def _trip(self, model: _Model, state: _State, trip: Trip) -> None:
        state.trip = trip
        self._open[model] = state
        self.last_trip[model] = trip
        self._changed.set()
        log.warning(
            "model_breaker_open",
            model=model[0],
            version=model[1] or "latest",
            failures=trip.failures,
            outcomes=trip.outcomes,
        )
        if self._on_change is not None:
            self._on_change(*model, True)

    def _close(self, model: _Model) -> None:
        state = self._open.pop(model, None)
        if state is None:
            return
        opened_s = time.monotonic() - state.trip.at if state.trip else 0.0
        state.trip = None
        state.outcomes.clear()  # they belong to the release that failed
        state.failures = 0
        while state.waiters:
            waiter = state.waiters.popleft()
            if not waiter.done():
                waiter.set_result(False)
        log.info(
            "model_breaker_closed",
            model=model[0],
            version=model[1] or "latest",
            open_s=round(opened_s, 3),
        )
        if self._on_change is not None:
            self._on_change(*model, False)

    def _probe_ended(self, model: _Model) -> None:
        state = self._models.get(model)
        if state is not None:
            state.probing = False
