"""An adaptive in-flight limit, in the manner of Netflix's concurrency-limits.

The best window is the smallest one that keeps Triton saturated: below it
throughput is lost, above it requests only queue (latency rises, throughput
does not). Its size depends on the model, the payload and the machine, so it
is discovered rather than configured.

Samples are grouped into windows of about one limit's worth of completions.
At the end of each window:

- an overload (RESOURCE_EXHAUSTED, a timeout) seen in it cuts the limit
  multiplicatively (once per window: the requests already in flight when the
  first overload arrived must not cut it again);
- a window that completed at least ``rate_gain`` more requests per second
  than any before it shows that more in flight buys throughput (with
  micro-batching, larger batches): the limit grows, and the latency seen there
  becomes the reference, even when it is above the floor;
- an average latency above ``tolerance`` x the reference (the lowest window
  average seen, or the latency where throughput last grew) means a queue is
  building without more throughput: the limit shrinks a little;
- otherwise, if the window was actually used (in flight reached half the
  limit), the limit grows by about its square root.

The floor is only ever measured at low queueing, so it must be refreshed: every
``probe_every_windows`` windows the limit is halved for two windows (one to
drain, one to measure) and the floor is re-measured there, like TCP BBR's
PROBE_RTT. Without this a floor measured long ago would let the limit creep.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from worker.flow.window import Window

__all__ = ["AdaptiveLimiter", "LimiterSettings"]


@dataclass(frozen=True, slots=True)
class LimiterSettings:
    """Tuning knobs; the defaults need no change for the worker's use."""

    #: Latency above this multiple of the floor counts as queueing.
    tolerance: float = 1.5
    #: Multiplicative cut on overload.
    backoff_ratio: float = 0.7
    #: Multiplicative cut when latency rises past the tolerance.
    latency_backoff_ratio: float = 0.9
    #: Fewest samples in a window (small limits still average a few samples).
    min_window_samples: int = 10
    #: Most samples in a window (large limits still react quickly).
    max_window_samples: int = 200
    #: Windows between two floor probes.
    probe_every_windows: int = 100
    #: A window this much faster than the best before it counts as more throughput.
    rate_gain: float = 1.05


class AdaptiveLimiter:
    """Drives ``window.limit`` between ``min_limit`` and ``max_limit`` from latency samples."""

    def __init__(
        self,
        window: Window,
        min_limit: int,
        max_limit: int,
        settings: LimiterSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Start at ``min_limit`` and set ``window.limit`` to it; ``clock`` times windows."""
        if not 1 <= min_limit <= max_limit:
            raise ValueError(f"need 1 <= min_limit <= max_limit, got {min_limit}, {max_limit}")
        self._window = window
        self._min = min_limit
        self._max = max_limit
        self._settings = settings or LimiterSettings()
        self._estimate = float(min_limit)
        self._floor_s = math.inf
        self._windows = 0
        self._probe_stage = 0  # 0: normal; 2: draining; 1: measuring
        self._before_probe = float(min_limit)
        # The current window's samples.
        self._count = 0
        self._sum_s = 0.0
        self._overloads = 0
        self._peak_in_flight = 0
        self._clock = clock
        self._window_started = clock()
        self._best_rate = 0.0
        self._earned_s = 0.0
        self._apply()

    @property
    def limit(self) -> int:
        """The current limit (also set on the window)."""
        return self._window.limit

    @property
    def floor_s(self) -> float:
        """The lowest window-average latency seen (inf before the first window)."""
        return self._floor_s

    def on_success(self, latency_s: float, count: int = 1) -> None:
        """``count`` requests completed in ``latency_s`` seconds (a micro-batch: together)."""
        self._count += count
        self._sum_s += latency_s * count
        self._peak_in_flight = max(self._peak_in_flight, self._window.in_flight)
        self._maybe_close_window()

    def on_overload(self) -> None:
        """Triton shed a request (RESOURCE_EXHAUSTED) or it timed out."""
        self._count += 1
        self._overloads += 1
        self._maybe_close_window()

    def _reset_window(self) -> None:
        self._count = 0
        self._sum_s = 0.0
        self._overloads = 0
        self._peak_in_flight = 0

    def _window_size(self) -> int:
        s = self._settings
        return max(s.min_window_samples, min(s.max_window_samples, self.limit))

    def _maybe_close_window(self) -> None:
        if self._count < self._window_size():
            return
        successes = self._count - self._overloads
        average_s = self._sum_s / successes if successes > 0 else math.inf
        now = self._clock()
        rate = successes / max(now - self._window_started, 1e-9)
        self._window_started = now
        self._windows += 1
        self._update(average_s, rate)
        self._reset_window()
        self._apply()

    def _update(self, average_s: float, rate: float) -> None:
        s = self._settings
        if self._probe_stage:
            self._probe(average_s)
            return
        if average_s < self._floor_s:
            self._floor_s = average_s
        used = 2 * self._peak_in_flight >= self._estimate
        if self._overloads > 0:
            self._estimate *= s.backoff_ratio
        elif used and rate > s.rate_gain * self._best_rate and math.isfinite(average_s):
            # More in flight bought throughput: its latency is the price, not queueing.
            self._best_rate = rate
            self._earned_s = average_s
            self._floor_s = max(self._floor_s, average_s)
            self._estimate += math.sqrt(self._estimate)
        elif average_s > s.tolerance * self._floor_s:
            self._estimate *= s.latency_backoff_ratio
        elif used:
            # Grow only when the limit is what holds traffic back.
            self._estimate += math.sqrt(self._estimate)
        if self._windows % s.probe_every_windows == 0:
            self._before_probe = self._estimate
            self._estimate = max(self._min, self._estimate / 2)
            self._probe_stage = 2

    def _probe(self, average_s: float) -> None:
        self._probe_stage -= 1
        if self._probe_stage == 0:
            # The measuring window ran at half the limit: take its latency as the floor.
            if math.isfinite(average_s) and self._overloads == 0:
                # Latency earned by throughput (see _update) stays acceptable.
                self._floor_s = max(average_s, self._earned_s)
            self._estimate = self._before_probe * (
                self._settings.backoff_ratio if self._overloads > 0 else 1.0
            )

    def _apply(self) -> None:
        self._estimate = min(float(self._max), max(float(self._min), self._estimate))
        limit = round(self._estimate)
        if limit != self._window.limit:
            self._window.limit = limit
