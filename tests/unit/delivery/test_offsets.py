"""Offset tracking: commit points under out-of-order completion, gaps and reassignment."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from aiokafka.structs import TopicPartition
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from worker.delivery.offsets import OffsetTracker, PartitionOffsets

pytestmark = pytest.mark.timeout(120)

TP0 = TopicPartition("requests", 0)
TP1 = TopicPartition("requests", 1)


def expected_point(tracked: list[int], done: set[int]) -> int | None:
    """Reference commit point, computed the slow and obvious way."""
    if not tracked:
        return None
    not_done = [offset for offset in tracked if offset not in done]
    return min(not_done) if not_done else tracked[-1] + 1


def test_nothing_tracked_has_no_commit_point() -> None:
    """A fresh partition has nothing to commit and nothing pending."""
    state = PartitionOffsets(42)
    assert state.commit_point() is None
    assert state.pending() == 0
    assert state.done_beyond_commit() == []


def test_in_order_completion_commits_past_the_last() -> None:
    """Records done in order move the commit point to last + 1."""
    state = PartitionOffsets(10)
    for offset in (10, 11, 12):
        state.track(offset)
    assert state.commit_point() == 10
    state.done(10)
    state.done(11)
    assert state.commit_point() == 12
    state.done(12)
    assert state.commit_point() == 13
    assert state.pending() == 0
    assert state.backlog() == 0


def test_out_of_order_completion_holds_at_lowest_pending() -> None:
    """A slow record holds the commit point while later ones finish."""
    state = PartitionOffsets(0)
    for offset in range(5):
        state.track(offset)
    for offset in (4, 2, 1, 3):
        state.done(offset)
    assert state.commit_point() == 0
    assert state.done_beyond_commit() == [1, 2, 3, 4]
    assert state.backlog() == 5
    state.done(0)
    assert state.commit_point() == 5
    assert state.done_beyond_commit() == []


def test_gaps_never_block() -> None:
    """Offsets missing from the log (compaction, markers) do not hold the commit point."""
    state = PartitionOffsets(100)
    for offset in (103, 107, 108):
        state.track(offset)
    assert state.commit_point() == 103
    state.done(103)
    assert state.commit_point() == 107
    state.done(108)
    assert state.commit_point() == 107
    assert state.done_beyond_commit() == [108]
    state.done(107)
    assert state.commit_point() == 109


@pytest.mark.parametrize(
    ("tracked", "bad"),
    [([], 5), ([5], 6), ([5], 4)],
    ids=["nothing-tracked", "above", "below"],
)
def test_done_on_untracked_offset_is_loud(tracked: list[int], bad: int) -> None:
    """Completing an offset that was never tracked raises ValueError."""
    state = PartitionOffsets(0)
    for offset in tracked:
        state.track(offset)
    with pytest.raises(ValueError, match="not pending"):
        state.done(bad)


def test_done_twice_is_loud() -> None:
    """Completing a record twice raises ValueError, whether or not it was popped."""
    state = PartitionOffsets(0)
    state.track(0)
    state.track(1)
    state.done(1)
    with pytest.raises(ValueError, match="not pending"):
        state.done(1)
    state.done(0)
    with pytest.raises(ValueError, match="not pending"):
        state.done(0)
    assert state.commit_point() == 2


@pytest.mark.parametrize(("start", "offsets"), [(10, [9]), (0, [3, 3]), (0, [5, 4])])
def test_track_out_of_order_is_loud(start: int, offsets: list[int]) -> None:
    """Tracking below the start or not strictly increasing raises ValueError."""
    state = PartitionOffsets(start)
    with pytest.raises(ValueError, match="out of order"):
        for offset in offsets:
            state.track(offset)


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(min_value=0, max_value=1_000),
    gaps=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=60),
    data=st.data(),
)
def test_commit_point_matches_reference(start: int, gaps: list[int], data: st.DataObject) -> None:
    """Random interleavings of track and done keep the commit point exact and monotone."""
    offsets: list[int] = []
    offset = start
    for gap in gaps:
        offset += gap
        offsets.append(offset)
        offset += 1
    state = PartitionOffsets(start)
    tracked: list[int] = []
    done: set[int] = set()
    previous: int | None = None
    while len(done) < len(offsets):
        not_done = [o for o in tracked if o not in done]
        can_track = len(tracked) < len(offsets)
        if can_track and (not not_done or data.draw(st.booleans(), label="track")):
            state.track(offsets[len(tracked)])
            tracked.append(offsets[len(tracked)])
        else:
            finished = data.draw(st.sampled_from(not_done), label="done")
            state.done(finished)
            done.add(finished)
        point = state.commit_point()
        assert point == expected_point(tracked, done)
        assert point is not None
        assert previous is None or point >= previous
        previous = point
        assert state.pending() == len(tracked) - len(done)
        assert state.done_beyond_commit() == sorted(o for o in done if o > point)
    assert state.commit_point() == offsets[-1] + 1
    assert state.backlog() == 0


def test_tracker_drops_late_completion_after_revoke() -> None:
    """A completion arriving after its partition was revoked is ignored."""
    tracker = OffsetTracker()
    tracker.assign(TP0, 0)
    generation = tracker.track(TP0, 0)
    revoked = tracker.revoke(TP0)
    assert revoked is not None and revoked.pending() == 1
    assert tracker.done(TP0, 0, generation) is False
    assert tracker.pending() == 0
    assert tracker.commit_offsets() == {}


def test_tracker_drops_completion_from_earlier_assignment() -> None:
    """After revoke and reassign, an old generation cannot complete a re-dispatched record."""
    tracker = OffsetTracker()
    tracker.assign(TP0, 5)
    old = tracker.track(TP0, 5)
    tracker.revoke(TP0)
    tracker.assign(TP0, 5)
    new = tracker.track(TP0, 5)
    assert new > old
    assert tracker.done(TP0, 5, old) is False
    assert tracker.commit_offsets() == {TP0: 5}
    assert tracker.done(TP0, 5, new) is True
    assert tracker.commit_offsets() == {TP0: 6}


def test_tracker_reports_only_advanced_partitions() -> None:
    """commit_offsets lists a partition again only once its point moved past the mark."""
    tracker = OffsetTracker()
    tracker.assign(TP0, 0)
    tracker.assign(TP1, 50)
    g0 = tracker.track(TP0, 0)
    g1 = tracker.track(TP1, 50)
    tracker.track(TP1, 51)
    assert tracker.commit_offsets() == {TP0: 0, TP1: 50}
    tracker.mark_committed({TP0: 0, TP1: 50})
    assert tracker.commit_offsets() == {}
    assert tracker.done(TP1, 51, g1)
    assert tracker.commit_offsets() == {}
    assert tracker.done_beyond_commit(TP1) == [51]
    assert tracker.done(TP0, 0, g0)
    assert tracker.commit_offsets() == {TP0: 1}
    tracker.mark_committed({TP0: 1, TopicPartition("other", 9): 3})
    assert tracker.commit_offsets() == {}
    assert tracker.pending() == 1
    assert tracker.pending(TP1) == 1
    assert tracker.assigned() == frozenset({TP0, TP1})


def test_tracker_track_on_unassigned_partition_is_loud() -> None:
    """Dispatching a record of a partition we do not own raises KeyError."""
    tracker = OffsetTracker()
    with pytest.raises(KeyError, match="unassigned"):
        tracker.track(TP0, 0)


@dataclass(frozen=True)
class Ticket:
    """What the caller keeps for a dispatched record."""

    tp: TopicPartition
    offset: int
    generation: int


@dataclass
class ModelPartition:
    """The reference state of one assignment."""

    generation: int
    start: int
    tracked: list[int] = field(default_factory=list)
    done: set[int] = field(default_factory=set)
    committed: int | None = None
    last_point: int | None = None

    def point(self) -> int | None:
        """The reference commit point."""
        return expected_point(self.tracked, self.done)


class TrackerMachine(RuleBasedStateMachine):
    """OffsetTracker against a plain model: assign, revoke, track, done, commit."""

    dispatched = Bundle("dispatched")
    finished = Bundle("finished")

    @initialize()
    def setup(self) -> None:
        """Start with an empty tracker and model."""
        self.tracker = OffsetTracker()
        self.model: dict[TopicPartition, ModelPartition] = {}

    @rule(tp=st.sampled_from([TP0, TP1]), position=st.integers(min_value=0, max_value=6))
    def assign(self, tp: TopicPartition, position: int) -> None:
        """Assign (or re-assign) a partition at a small position, so offsets recur."""
        generation = self.tracker.assign(tp, position)
        previous = self.model.get(tp)
        assert previous is None or generation > previous.generation
        self.model[tp] = ModelPartition(generation=generation, start=position)

    @rule(tp=st.sampled_from([TP0, TP1]))
    def revoke(self, tp: TopicPartition) -> None:
        """Revoke a partition; its final state matches the model."""
        state = self.tracker.revoke(tp)
        expected = self.model.pop(tp, None)
        if expected is None:
            assert state is None
        else:
            assert state is not None
            assert state.generation == expected.generation
            assert state.pending() == len(expected.tracked) - len(expected.done)

    @precondition(lambda self: bool(self.model))
    @rule(target=dispatched, data=st.data(), gap=st.integers(min_value=0, max_value=2))
    def track(self, data: st.DataObject, gap: int) -> Ticket:
        """Dispatch the next record of an assigned partition, maybe after a gap."""
        tp = data.draw(st.sampled_from(sorted(self.model)), label="tp")
        part = self.model[tp]
        offset = (part.tracked[-1] + 1 if part.tracked else part.start) + gap
        generation = self.tracker.track(tp, offset)
        assert generation == part.generation
        part.tracked.append(offset)
        return Ticket(tp, offset, generation)

    @rule(target=finished, ticket=consumes(dispatched))
    def done(self, ticket: Ticket) -> Ticket:
        """Complete a dispatched record; stale generations and revoked partitions are ignored."""
        part = self.model.get(ticket.tp)
        current = part is not None and part.generation == ticket.generation
        assert self.tracker.done(ticket.tp, ticket.offset, ticket.generation) is current
        if part is not None and current:
            part.done.add(ticket.offset)
        return ticket

    @rule(ticket=finished)
    def done_again(self, ticket: Ticket) -> None:
        """Completing a record twice is loud in its own generation, ignored otherwise."""
        part = self.model.get(ticket.tp)
        if part is not None and part.generation == ticket.generation:
            with pytest.raises(ValueError, match="not pending"):
                self.tracker.done(ticket.tp, ticket.offset, ticket.generation)
        else:
            assert self.tracker.done(ticket.tp, ticket.offset, ticket.generation) is False

    @rule(accepted=st.booleans())
    def commit(self, accepted: bool) -> None:
        """Commit the advanced partitions; a failed commit leaves them to the next round."""
        offsets = self.tracker.commit_offsets()
        expected = {}
        for tp, part in self.model.items():
            point = part.point()
            if point is not None and (part.committed is None or point > part.committed):
                expected[tp] = point
        assert offsets == expected
        if accepted:
            self.tracker.mark_committed(offsets)
            for tp, offset in offsets.items():
                self.model[tp].committed = offset

    @invariant()
    def matches_model(self) -> None:
        """Every assigned partition has the model's commit point, pending set and done tail."""
        assert self.tracker.assigned() == frozenset(self.model)
        for tp, part in self.model.items():
            point = self.tracker.commit_point(tp)
            assert point == part.point()
            if point is not None:
                assert part.last_point is None or point >= part.last_point
                part.last_point = point
                assert self.tracker.done_beyond_commit(tp) == sorted(
                    o for o in part.done if o > point
                )
            assert self.tracker.pending(tp) == len(part.tracked) - len(part.done)
            assert self.tracker.generation(tp) == part.generation
        assert self.tracker.pending() == sum(
            len(p.tracked) - len(p.done) for p in self.model.values()
        )


TrackerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
TestTrackerMachine = TrackerMachine.TestCase
TestTrackerMachine.__doc__ = "Stateful check of OffsetTracker against the model."


def test_done_many_equals_done_one_by_one_and_drops_stale_generations() -> None:
    """done_many marks a set at once (commit point and done runs as with done); stale: nothing."""
    one, many = OffsetTracker(), OffsetTracker()
    g1, g2 = one.assign(TP0, 0), many.assign(TP0, 0)
    for offset in range(8):
        one.track(TP0, offset)
        many.track(TP0, offset)
    for offset in (0, 1, 3, 5):
        one.done(TP0, offset, g1)
    assert many.done_many(TP0, [0, 1, 3, 5], g2) is True
    assert many.commit_point(TP0) == one.commit_point(TP0) == 2
    assert many.done_beyond_commit(TP0) == one.done_beyond_commit(TP0) == [3, 5]
    assert many.done_many(TP0, [2, 4], g2 + 100) is False
    assert many.pending(TP0) == 4
    with pytest.raises(ValueError):
        many.done_many(TP0, [2, 3], g2)  # 3 is done already: loud
