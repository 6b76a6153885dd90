"""Adaptive limit against a simulated server whose latency depends on concurrency."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np
import pytest

from worker.flow.limiter import AdaptiveLimiter
from worker.flow.window import Window

pytestmark = pytest.mark.timeout(20)


@dataclass
class Server:
    """Saturates at ``knee`` concurrent requests; sheds what exceeds ``queue`` (if set)."""

    knee: int = 32
    base_latency_s: float = 0.002
    queue: int | None = None
    noise: float = 0.1

    def latency_s(self, concurrency: int) -> float:
        return self.base_latency_s * max(1.0, concurrency / self.knee)

    def throughput(self, concurrency: int) -> float:
        return min(concurrency, self.knee) / self.base_latency_s


@dataclass
class SimClock:
    """Simulated time: each round advances it by that round's latency."""

    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s


#: Shared by every test: it only moves forward, and each limiter reads it from its creation.
CLOCK = SimClock()


@dataclass
class Round:
    limit: int
    in_flight: int
    overloads: int


def drive(
    limiter: AdaptiveLimiter,
    window: Window,
    server: Server,
    rounds: int,
    offered: int | None = None,
    seed: int = 1,
) -> list[Round]:
    """Closed loop: each round fills the window (up to ``offered``), then completes it.

    A round is one round trip: every request in flight completes once, with the
    server's latency at that concurrency (log-normal noise), or is shed.
    """
    rng = np.random.default_rng(seed)
    history = []
    for _ in range(rounds):
        want = window.limit if offered is None else min(window.limit, offered)
        held = 0
        while held < want and window.try_acquire("p"):
            held += 1
        shed = 0 if server.queue is None else max(0, held - server.queue)
        latency_s = server.latency_s(held - shed)
        for i in range(held):
            # Completions spread evenly over the round trip.
            CLOCK.now_s += latency_s / held
            if i < shed:
                limiter.on_overload()
            else:
                limiter.on_success(latency_s * float(rng.lognormal(0.0, server.noise)))
        for _ in range(held):
            window.release("p")
        history.append(Round(window.limit, held, shed))
    return history


def test_converges_near_the_best_limit() -> None:
    """From the minimum, the limit settles where throughput is full but queueing is small."""
    window = Window(limit=4, per_partition_limit=10_000)
    limiter = AdaptiveLimiter(window, min_limit=4, max_limit=1024, clock=CLOCK)
    server = Server(knee=32)
    history = drive(limiter, window, server, rounds=400)
    settled = [r.in_flight for r in history[200:]]
    throughput = statistics.mean(server.throughput(c) for c in settled)
    assert throughput >= 0.9 * server.throughput(server.knee)
    # Above the knee only latency grows: stay within twice the best limit.
    assert statistics.median(settled) <= 2 * server.knee
    assert limiter.limit == window.limit


def test_reaches_the_best_limit_quickly_from_the_minimum() -> None:
    """Growth is fast enough to reach a knee of 128 within 60 round trips."""
    window = Window(limit=4, per_partition_limit=10_000)
    limiter = AdaptiveLimiter(window, min_limit=4, max_limit=1024, clock=CLOCK)
    history = drive(limiter, window, Server(knee=128), rounds=60)
    assert max(r.limit for r in history) >= 128


def test_backs_off_on_overload_and_stays_below_the_shedding_point() -> None:
    """A server that sheds above 40 in flight pulls a converged limit down, and keeps it there."""
    window = Window(limit=4, per_partition_limit=10_000)
    limiter = AdaptiveLimiter(window, min_limit=4, max_limit=1024, clock=CLOCK)
    drive(limiter, window, Server(knee=128), rounds=100)
    assert limiter.limit > 80
    history = drive(limiter, window, Server(knee=128, queue=40), rounds=300)
    assert min(r.limit for r in history[:10]) <= 40
    settled = history[100:]
    shed = sum(r.overloads for r in settled) / sum(r.in_flight for r in settled)
    assert shed < 0.05
    assert statistics.median(r.limit for r in settled) >= 20


def test_does_not_grow_when_traffic_is_below_the_limit() -> None:
    """With only 5 requests ever offered, the limit stays small (it is not what limits)."""
    window = Window(limit=4, per_partition_limit=10_000)
    limiter = AdaptiveLimiter(window, min_limit=4, max_limit=1024, clock=CLOCK)
    drive(limiter, window, Server(knee=64), rounds=300, offered=5)
    assert limiter.limit <= 16


def test_shrinks_when_latency_rises_without_errors() -> None:
    """When the server slows down fourfold, the limit comes down with it."""
    window = Window(limit=4, per_partition_limit=10_000)
    limiter = AdaptiveLimiter(window, min_limit=4, max_limit=1024, clock=CLOCK)
    drive(limiter, window, Server(knee=128), rounds=150)
    before = limiter.limit
    # Same floor latency, but saturating at a quarter of the concurrency.
    history = drive(limiter, window, Server(knee=32), rounds=300)
    assert statistics.median(r.limit for r in history[150:]) <= before / 2
    assert statistics.median(r.limit for r in history[150:]) <= 2 * 32


def test_stays_within_its_bounds() -> None:
    """The limit never leaves [min_limit, max_limit], whatever the server does."""
    window = Window(limit=4, per_partition_limit=10_000)
    limiter = AdaptiveLimiter(window, min_limit=8, max_limit=50, clock=CLOCK)
    history = drive(limiter, window, Server(knee=500), rounds=100)
    history += drive(limiter, window, Server(knee=500, queue=1), rounds=100)
    assert all(8 <= r.limit <= 50 for r in history)
    assert max(r.limit for r in history) == 50
    with pytest.raises(ValueError):
        AdaptiveLimiter(window, min_limit=10, max_limit=5, clock=CLOCK)


@dataclass
class BatchingServer(Server):
    """Batches what is in flight: latency grows with concurrency, and so does throughput."""

    def latency_s(self, concurrency: int) -> float:
        batched = min(concurrency, self.knee)
        queued = max(1.0, concurrency / self.knee)
        return self.base_latency_s * (1 + batched / 16) * queued

    def throughput(self, concurrency: int) -> float:
        return concurrency / self.latency_s(concurrency)


def test_grows_past_the_latency_floor_while_throughput_grows() -> None:
    """Where larger batches cost latency but buy throughput, the limit still reaches >= 80 %."""
    window = Window(limit=4, per_partition_limit=10_000)
    limiter = AdaptiveLimiter(window, min_limit=4, max_limit=1024, clock=CLOCK)
    server = BatchingServer(knee=256)
    history = drive(limiter, window, server, rounds=600)
    settled = [r.in_flight for r in history[300:]]
    throughput = statistics.mean(server.throughput(c) for c in settled)
    assert throughput >= 0.8 * server.throughput(server.knee)
    assert statistics.median(settled) <= 2 * server.knee
