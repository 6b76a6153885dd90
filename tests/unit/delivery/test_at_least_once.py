"""at_least_once bookkeeping: done after the ack, commits of the done prefix, revocation.

The consumer side is an in-memory CommitEdge (the seam delivery talks to), so the
test can make a commit fail on demand, which a real broker will not do when asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from aiokafka.errors import CommitFailedError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition

from worker.delivery import AtLeastOnce
from worker.delivery.offsets import OffsetTracker
from worker.observability import Metrics

pytestmark = pytest.mark.timeout(10)

TP = TopicPartition("in", 0)


class Edge:
    """The consumer as delivery sees it: commits are recorded, or fail when told."""

    def __init__(self) -> None:
        self.commits: list[dict[TopicPartition, int]] = []
        self.fail_next = False

    def assignment(self) -> set[TopicPartition]:
        return {TP}

    def highwater(self, tp: TopicPartition) -> int | None:
        return 100

    async def commit(self, offsets: Mapping[TopicPartition, OffsetAndMetadata]) -> None:
        if self.fail_next:
            self.fail_next = False
            raise CommitFailedError("rebalancing")
        self.commits.append({tp: meta.offset for tp, meta in offsets.items()})


def record(offset: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord("in", 0, offset, 0, 0, b"k", b"v", None, 1, 1, [])


def delivery() -> tuple[AtLeastOnce, Edge, Metrics]:
    edge, metrics = Edge(), Metrics(version="test")
    sink: Any = None  # outcomes are delivered by the callables the tests pass
    return AtLeastOnce(sink, OffsetTracker(), edge, metrics, interval_s=1.0), edge, metrics


async def test_a_record_is_done_only_after_its_outcome_is_delivered() -> None:
    """complete() runs the delivery first; a delivery that raises leaves the record pending."""
    d, edge, _ = delivery()
    tickets = [d.track(record(o)) for o in (5, 6)]

    async def broken() -> None:
        raise RuntimeError("broker gone")

    with pytest.raises(RuntimeError):
        await d.complete(record(5), tickets[0], broken)
    delivered: list[int] = []

    async def ok() -> None:
        delivered.append(6)

    await d.complete(record(6), tickets[1], ok)
    await d.commit()
    assert delivered == [6]
    assert edge.commits == [{TP: 5}]  # 5 is not done: the commit stops there


async def test_commits_follow_the_done_prefix_and_only_when_it_moves() -> None:
    """Out-of-order completions commit up to the lowest unfinished; nothing new, no commit."""
    d, edge, metrics = delivery()
    tickets = {o: d.track(record(o)) for o in range(10, 14)}

    async def nothing() -> None:
        return None

    for offset in (11, 10, 13):
        await d.complete(record(offset), tickets[offset], nothing)
    await d.commit()
    await d.commit()
    assert edge.commits == [{TP: 12}]
    await d.complete(record(12), tickets[12], nothing)
    await d.commit()
    assert edge.commits[-1] == {TP: 14}
    assert metrics.registry.get_sample_value("worker_commits_total") == 2


async def test_a_failed_commit_is_counted_and_retried_by_the_next_one() -> None:
    """A commit refused during a rebalance is not fatal: the next commit carries it."""
    d, edge, metrics = delivery()
    ticket = d.track(record(0))

    async def nothing() -> None:
        return None

    await d.complete(record(0), ticket, nothing)
    edge.fail_next = True
    await d.commit()
    assert edge.commits == []
    assert metrics.registry.get_sample_value("worker_commit_failures_total") == 1
    await d.commit()
    assert edge.commits == [{TP: 1}]


async def test_revocation_commits_what_is_done_and_drops_late_completions() -> None:
    """After revoked(), a record of the old assignment completing late changes nothing."""
    d, edge, _ = delivery()
    first, late = d.track(record(0)), d.track(record(1))

    async def nothing() -> None:
        return None

    await d.complete(record(0), first, nothing)
    await d.revoked({TP})
    assert edge.commits == [{TP: 1}]
    await d.complete(record(1), late, nothing)  # stale: ignored, no error
    again = d.track(record(1))  # the next assignment starts where the commit left off
    assert again != late
    assert d.offsets.commit_point(TP) == 1


async def test_lag_is_the_distance_from_the_commit_point_to_the_end() -> None:
    """The lag gauge of a partition is its end offset minus its commit point."""
    d, _, metrics = delivery()
    d.track(record(40))
    d._update_lag()
    labels: dict[str, Any] = {"topic": "in", "partition": "0"}
    assert metrics.registry.get_sample_value("worker_consumer_lag", labels) == 60
