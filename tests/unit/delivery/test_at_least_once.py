"""at_least_once bookkeeping: done after the ack, commits of the done prefix, revocation.

The consumer side is an in-memory CommitEdge (the seam delivery talks to), so the
test can make a commit fail on demand, which a real broker will not do when asked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
import structlog
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.structs import OffsetAndMetadata

from tests.unit.delivery.fakes import TP, Edge, ours, record
from worker.delivery import AtLeastOnce
from worker.delivery.offsets import OffsetTracker
from worker.observability import Metrics

pytestmark = pytest.mark.timeout(10)


class Publisher:
    """publish_many of the publisher: records each call; the offsets in ``refuse`` fail."""

    def __init__(self, *, enqueues: bool = True) -> None:
        self.calls: list[list[int]] = []
        self.refuse: set[int] = set()
        self.enqueues = enqueues  # False: the producer could not take them at all
        self.acks = asyncio.Event()  # the broker's acks, held until set
        self.acks.set()
        self.enqueued = asyncio.Event()

    async def publish_many(
        self, results: Sequence[tuple[Any, bytes, Any]], *, enqueued: Any = None
    ) -> list[Any]:
        self.calls.append([r.offset for r, _, _ in results])
        if self.enqueues and enqueued is not None:
            enqueued()
        self.enqueued.set()
        await self.acks.wait()
        return [
            MessageSizeTooLargeError() if r.offset in self.refuse else None for r, _, _ in results
        ]


def delivery(
    edge: Edge | None = None, max_uncommitted: int = 1000, sink: Any = None
) -> tuple[AtLeastOnce, Edge, Metrics]:
    """at_least_once over ``edge``; outcomes are delivered by the callables the tests pass,
    results of several records at once by ``sink``'s publish_many."""
    edge, metrics = edge or Edge(highwater=100), Metrics(version="test")
    built = AtLeastOnce(
        sink, OffsetTracker(), edge, metrics, interval_s=1.0, max_uncommitted=max_uncommitted
    )
    return built, edge, metrics


def nothing() -> None:
    """An on_safe callback with nothing to release."""


async def delivered() -> None:
    """A delivery that succeeds (the broker acknowledged)."""


async def test_a_record_is_done_only_after_its_outcome_is_delivered() -> None:
    """complete() runs the delivery first; a delivery that raises leaves the record pending."""
    d, edge, _ = delivery()
    tickets = [d.track(record(o)) for o in (5, 6)]

    async def broken() -> None:
        raise RuntimeError("broker gone")

    with pytest.raises(RuntimeError):
        await d.complete(record(5), tickets[0], broken, nothing)
    delivered: list[int] = []

    async def ok() -> None:
        delivered.append(6)

    await d.complete(record(6), tickets[1], ok, nothing)
    await d.commit()
    assert delivered == [6]
    assert edge.commits == [{TP: 5}]  # 5 is not done: the commit stops there


async def test_commits_follow_the_done_prefix_and_only_when_it_moves() -> None:
    """Out-of-order completions commit up to the lowest unfinished; nothing new, no commit."""
    d, edge, metrics = delivery()
    tickets = {o: d.track(record(o)) for o in range(10, 14)}

    for offset in (11, 10, 13):
        await d.complete(record(offset), tickets[offset], delivered, nothing)
    await d.commit()
    await d.commit()
    assert edge.commits == [{TP: 12}]
    await d.complete(record(12), tickets[12], delivered, nothing)
    await d.commit()
    assert edge.commits[-1] == {TP: 14}
    assert metrics.registry.get_sample_value("worker_commits_total") == 2


async def test_a_failed_commit_is_counted_and_retried_by_the_next_one() -> None:
    """A commit refused during a rebalance is not fatal: the next commit carries it."""
    d, edge, metrics = delivery()
    ticket = d.track(record(0))

    await d.complete(record(0), ticket, delivered, nothing)
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

    await d.complete(record(0), first, delivered, nothing)
    await d.revoked({TP})
    assert edge.commits == [{TP: 1}]
    await d.complete(record(1), late, delivered, nothing)  # stale: ignored, no error
    again = d.track(record(1))  # the next assignment starts where the commit left off
    assert again != late
    assert d.offsets.commit_point(TP) == 1


async def test_a_lost_partition_is_forgotten_without_a_commit() -> None:
    """Lost (the group moved on): no commit is tried; the next assignment starts afresh."""
    d, edge, _ = delivery()
    first = d.track(record(0))
    await d.complete(record(0), first, delivered, nothing)
    await d.revoked({TP}, lost=True)
    assert edge.commits == []
    assert d.offsets.commit_point(TP) is None


async def test_lag_is_the_distance_from_the_commit_point_to_the_end() -> None:
    """The lag gauge of a partition is its end offset minus its commit point."""
    d, _, metrics = delivery()
    d.track(record(40))
    d._update_lag()
    labels: dict[str, Any] = {"topic": "in", "partition": "0"}
    assert metrics.registry.get_sample_value("worker_consumer_lag", labels) == 60


async def test_done_runs_beyond_the_point_travel_in_the_commit_metadata() -> None:
    """One record stuck at the head: the commit stays there, the later done ones are listed."""
    d, edge, _ = delivery()
    tickets = {o: d.track(record(o)) for o in range(100, 110)}
    for offset in range(101, 110):
        await d.complete(record(offset), tickets[offset], delivered, nothing)
    await d.commit()
    assert edge.commits == [{TP: 100}]
    assert edge.metadata == [{TP: ours(100, "1+8")}]  # 101..109 done beyond the commit point
    await d.commit()
    assert len(edge.commits) == 1  # nothing moved: no second commit


async def test_a_member_starting_from_that_commit_skips_the_listed_records() -> None:
    """The next owner reads the metadata on assignment and settles the listed records at once."""
    edge = Edge(
        highwater=100, committed={TP: OffsetAndMetadata(100, ours(100, "2+1,5+0"))}
    )  # 102, 103, 105 done
    d, _, metrics = delivery(edge)
    await d.assigned({TP})
    settled = [o for o in range(100, 107) if d.settle_if_done(record(o), d.track(record(o)))]
    assert settled == [102, 103, 105]
    assert metrics.registry.get_sample_value("worker_records_skipped_total") == 3
    assert d.offsets.pending(TP) == 4  # 100, 101, 104, 106 are processed


async def test_metadata_of_another_start_is_not_used() -> None:
    """A partition starting elsewhere than the commit (offset reset) skips nothing."""
    edge = Edge(highwater=100, committed={TP: OffsetAndMetadata(100, ours(100, "2+1"))})
    d, _, _ = delivery(edge)
    await d.assigned({TP})
    assert not d.settle_if_done(record(150), d.track(record(150)))
    assert not d.settle_if_done(record(152), d.track(record(152)))


@pytest.mark.parametrize(
    "text",
    [ours(100, "1+7fffffffffffffff"), ours(100, "1+3e8"), "other-tool:v2", "d1:2+1"],
)
async def test_metadata_it_could_not_have_written_is_ignored_logged_once_and_counted(
    text: str,
) -> None:
    """A run past the bound (or past sys.maxsize), another format, or the first one (which
    has no check): every record processed."""
    edge = Edge(highwater=100, committed={TP: OffsetAndMetadata(100, text)})
    d, _, metrics = delivery(edge, max_uncommitted=1000)
    with structlog.testing.capture_logs() as logs:
        await d.assigned({TP})
    settled = [o for o in range(100, 110) if d.settle_if_done(record(o), d.track(record(o)))]
    assert settled == []
    assert d.offsets.pending(TP) == 10
    assert [e["event"] for e in logs] == ["commit_metadata_ignored"]
    assert logs[0]["partition"] == str(TP) and logs[0]["offset"] == 100
    assert metrics.registry.get_sample_value("worker_commit_metadata_ignored_total") == 1


async def test_a_run_within_the_bound_is_trusted() -> None:
    """The farthest run a worker with this bound could have written is still skipped."""
    edge = Edge(
        highwater=100, committed={TP: OffsetAndMetadata(100, ours(100, "3e7+0"))}
    )  # point + 999, the bound being 1000
    d, _, metrics = delivery(edge, max_uncommitted=1000)
    await d.assigned({TP})
    assert not d.settle_if_done(record(100), d.track(record(100)))
    assert d.settle_if_done(record(1099), d.track(record(1099)))
    assert metrics.registry.get_sample_value("worker_commit_metadata_ignored_total") == 0


async def test_a_partition_may_not_run_past_its_uncommitted_bound() -> None:
    """With a bound of 3, a stuck head record lets 2 more be dispatched, then it pauses."""
    d, _, _ = delivery(max_uncommitted=3)
    tickets = {o: d.track(record(o)) for o in (0, 1, 2)}
    assert not d.admits(TP)
    await d.complete(record(0), tickets[0], delivered, nothing)
    assert d.admits(TP)


async def test_results_of_several_records_go_together_and_the_acked_are_done() -> None:
    """complete_many: one publish_many; the acknowledged records done at once, a refused
    one not (its error returned: the caller completes it alone)."""
    publisher = Publisher()
    publisher.refuse = {11}
    d, edge, _ = delivery(sink=publisher)
    records = [record(o) for o in range(10, 14)]
    tickets = [d.track(r) for r in records]
    refused: list[tuple[int, str]] = []
    await d.complete_many(
        [(r, b"v", []) for r in records],
        tickets,
        on_refused=lambda i, error: refused.append((i, type(error).__name__)),
    )
    assert publisher.calls == [[10, 11, 12, 13]]
    assert refused == [(1, "MessageSizeTooLargeError")]
    assert d.offsets.commit_point(TP) == 11
    assert d.offsets.done_beyond_commit(TP) == [12, 13]
    await d.commit()
    assert edge.commits == [{TP: 11}]


@pytest.mark.parametrize("enqueues", [True, False], ids=["enqueued", "not-enqueued"])
async def test_the_turns_pass_once_the_results_are_enqueued_not_acked(enqueues: bool) -> None:
    """complete_many's on_safe (a key's or partition's next records may go) is called once,
    as soon as the producer has every result enqueued (it writes them in that order), with
    the acks still outstanding and nothing done yet; when the producer could not take them
    at all, once, after."""
    publisher = Publisher(enqueues=enqueues)
    publisher.acks.clear()
    d, _, _ = delivery(sink=publisher)
    records = [record(o) for o in range(3)]
    tickets = [d.track(r) for r in records]
    safe: list[int | None] = []
    completing = asyncio.create_task(
        d.complete_many(
            [(r, b"v", []) for r in records],
            tickets,
            on_safe=lambda: safe.append(d.offsets.commit_point(TP)),
        )
    )
    await publisher.enqueued.wait()
    assert safe == ([0] if enqueues else [])  # acks outstanding, nothing done
    publisher.acks.set()
    await completing
    assert safe == [0]
    assert d.offsets.commit_point(TP) == 3


async def test_results_of_an_assignment_gone_are_not_marked_done() -> None:
    """Revoked and re-assigned while the acks were awaited: the old tickets change nothing."""
    publisher = Publisher()
    d, _, _ = delivery(sink=publisher)
    records = [record(o) for o in range(3)]
    tickets = [d.track(r) for r in records]
    await d.revoked({TP})
    again = d.track(record(0))
    assert again not in tickets
    await d.complete_many([(r, b"v", []) for r in records], tickets)
    assert d.offsets.commit_point(TP) == 0
    assert d.offsets.pending(TP) == 1
