"""What both delivery modes share: tracking from the first record, the commit loop, fatal ends.

The consumer is an in-memory CommitEdge; the mode under test is the shared base with a
commit that records its calls (the modes' own commits are tested with each mode).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import pytest
from aiokafka.structs import TopicPartition

from tests.unit.delivery.fakes import TP, Edge, record
from worker import errors
from worker.delivery.base import TrackingDelivery
from worker.delivery.offsets import OffsetTracker
from worker.observability import Metrics

pytestmark = pytest.mark.timeout(10)


class Counting(TrackingDelivery):
    """The base, whose commit counts its calls and tells the test of each."""

    def __init__(self, interval_s: float) -> None:
        super().__init__(
            OffsetTracker(), Edge(highwater=50), Metrics(version="test"), interval_s, 10
        )
        self.commits = 0
        self.committed = asyncio.Event()

    async def commit(self, only: Iterable[TopicPartition] | None = None) -> None:
        self.commits += 1
        self.committed.set()


def test_a_partition_is_tracked_from_its_first_record() -> None:
    """The first record dispatched since the assignment is where the partition starts."""
    delivery = Counting(1.0)
    delivery.track(record(40))
    delivery.track(record(42))  # a gap in the log (a compacted or transactional marker)
    assert delivery.offsets.commit_point(TP) == 40
    assert delivery.offsets.pending(TP) == 2


async def test_the_commit_loop_commits_and_gauges_the_lag_each_interval() -> None:
    """Every interval: a commit, then each partition's lag (its end minus its commit point)."""
    delivery = Counting(0.01)
    delivery.track(record(40))
    loop = asyncio.create_task(delivery.commit_loop())
    await delivery.committed.wait()
    delivery.committed.clear()
    await delivery.committed.wait()
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop
    labels = {"topic": "in", "partition": "0"}
    assert delivery._metrics.registry.get_sample_value("worker_consumer_lag", labels) == 10
    assert delivery.commits >= 2


async def test_a_mode_that_cannot_go_on_ends_the_commit_loop_with_its_error() -> None:
    """fail(error) (from a rebalance callback, which cannot raise): the loop raises it at
    once, whatever the interval, and only the first error counts."""
    delivery = Counting(3600.0)
    loop = asyncio.create_task(delivery.commit_loop())
    first = errors.WriteFailed("the dead letter cannot be written")
    delivery.fail(first)
    delivery.fail(errors.WriteFailed("a later one"))
    with pytest.raises(errors.WriteFailed) as caught:
        await asyncio.wait_for(loop, 5)
    assert caught.value is first and delivery.commits == 0
