"""Per-partition tracking of done offsets and the commit point.

Records of one partition are dispatched in offset order but complete out of
order (retries, parallel inference, batching). A partition may only be
committed up to its lowest record that is not yet done: committing further
would lose that record after a crash (at-most-once). This module keeps that
bookkeeping and nothing else; it never talks to Kafka.

Lifecycle, as driven by the intake and the publisher:

1. ``assign(tp, position)`` when the partition is assigned (or re-seeked);
2. ``generation = track(tp, offset)`` when a record is dispatched;
3. ``done(tp, offset, generation)`` once its result or dead letter is
   acknowledged by the broker;
4. periodically ``offsets = commit_offsets()``, commit them, then
   ``mark_committed(offsets)`` if the commit succeeded;
5. on revocation: drain, commit, then ``revoke(tp)``.

A completion that arrives after its partition was revoked, or that belongs to
an earlier assignment of the same partition (an older generation), is dropped:
the new owner re-delivers that record from the committed offset anyway, and
letting it through could mark a re-dispatched record done before it is.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from worker.kafka.types import TopicPartition

__all__ = ["OffsetTracker", "PartitionOffsets", "PartitionProgress"]


class PartitionProgress(NamedTuple):
    """One partition's bookkeeping at a glance (for ``/debug/inflight``)."""

    topic: str
    partition: int
    commit_point: int | None  # the next offset to commit
    highest_dispatched: int | None
    done_beyond_commit: int  # done offsets above the commit point


class PartitionOffsets:
    """Done offsets and the commit point of one partition assignment.

    Invariants:
    - ``_order`` holds, increasing, every tracked offset >= the commit point;
      its head (if any) is not done, so it *is* the commit point;
    - ``_pending`` is the set of tracked offsets not yet done;
    - ``_done`` is the set of done offsets still in ``_order`` (above the head).

    Each offset is appended once and popped once, so ``track`` and ``done``
    are O(1) amortised. Memory is proportional to the tracked offsets at or
    above the commit point (``backlog()``); a record stuck in retries keeps
    everything after it, so the intake should bound the backlog per partition.
    """

    __slots__ = (
        "_done",
        "_generation",
        "_high_water",
        "_last_tracked",
        "_order",
        "_pending",
        "_start",
    )

    def __init__(self, start: int, generation: int = 0) -> None:
        """Start tracking at ``start``, the first offset this assignment will see."""
        if start < 0:
            raise ValueError(f"start offset must be >= 0, got {start}")
        self._start = start
        self._generation = generation
        self._order: deque[int] = deque()
        self._pending: set[int] = set()
        self._done: set[int] = set()
        self._last_tracked: int | None = None
        # The highest commit point ever reported, to assert it never moves back.
        self._high_water: int | None = None

    @property
    def start(self) -> int:
        """The starting position given at creation."""
        return self._start

    @property
    def generation(self) -> int:
        """The assignment generation this state belongs to."""
        return self._generation

    @property
    def last_tracked(self) -> int | None:
        """The highest offset tracked so far, or None."""
        return self._last_tracked

    def track(self, offset: int) -> None:
        """Record that ``offset`` was dispatched; offsets must strictly increase.

        Gaps (compacted records, transaction markers) are allowed: an offset
        that is never tracked never holds the commit point back.
        """
        floor = self._start if self._last_tracked is None else self._last_tracked + 1
        if offset < floor:
            raise ValueError(f"offset {offset} tracked out of order: expected >= {floor}")
        self._order.append(offset)
        self._pending.add(offset)
        self._last_tracked = offset

    def done(self, offset: int) -> None:
        """Record that ``offset`` is finished (its output acknowledged by the broker).

        Raises ValueError if ``offset`` was never tracked or is already done:
        either means the caller's bookkeeping is broken, and a silent ignore
        could commit past an unfinished record.
        """
        try:
            self._pending.remove(offset)
        except KeyError:
            raise ValueError(
                f"offset {offset} is not pending (never tracked, or already done)"
            ) from None
        self._done.add(offset)
        order = self._order
        done = self._done
        # Pop the done prefix: the head of ``_order`` is then the commit point.
        while order and order[0] in done:
            done.remove(order.popleft())

    def done_many(self, offsets: Iterable[int]) -> None:
        """``done`` for each of ``offsets``, the done prefix popped once for all of them."""
        pending, done = self._pending, self._done
        for offset in offsets:
            try:
                pending.remove(offset)
            except KeyError:
                raise ValueError(
                    f"offset {offset} is not pending (never tracked, or already done)"
                ) from None
            done.add(offset)
        order = self._order
        while order and order[0] in done:
            done.remove(order.popleft())

    def commit_point(self) -> int | None:
        """The offset to commit: the lowest tracked offset not done, else last tracked + 1.

        None when nothing has been tracked yet (nothing to commit).
        """
        if self._last_tracked is None:
            return None
        point = self._order[0] if self._order else self._last_tracked + 1
        assert self._high_water is None or point >= self._high_water, (
            f"commit point moved backwards: {self._high_water} -> {point}"
        )
        self._high_water = point
        return point

    def pending(self) -> int:
        """How many tracked offsets are not done yet."""
        return len(self._pending)

    def backlog(self) -> int:
        """How many tracked offsets (done or not) are held at or above the commit point."""
        return len(self._order)

    def done_beyond_commit(self) -> list[int]:
        """The done offsets above the commit point, increasing.

        These are the records a restart would process again; they can be
        encoded into the commit metadata to skip them.
        """
        done = self._done
        return [offset for offset in self._order if offset in done]

    def done_beyond_count(self) -> int:
        """How many done offsets are above the commit point (O(1))."""
        return len(self._done)


class OffsetTracker:
    """PartitionOffsets for every assigned partition, with assignment generations.

    Generations come from one counter shared by all partitions, so every
    assignment gets a number that is unique in this tracker and strictly
    greater than any earlier assignment of the same partition.
    """

    def __init__(self) -> None:
        """Create an empty tracker with no partition assigned."""
        self._partitions: dict[TopicPartition, PartitionOffsets] = {}
        self._committed: dict[TopicPartition, int] = {}
        self._generations = itertools.count(1)

    def assign(self, tp: TopicPartition, position: int) -> int:
        """Start tracking ``tp`` from ``position``; returns the new generation.

        Assigning a partition that is already assigned replaces its state (for
        example after a seek): completions of the old state become stale.
        """
        generation = next(self._generations)
        self._partitions[tp] = PartitionOffsets(position, generation)
        self._committed.pop(tp, None)
        return generation

    def revoke(self, tp: TopicPartition) -> PartitionOffsets | None:
        """Stop tracking ``tp``; returns its final state, or None if not assigned."""
        self._committed.pop(tp, None)
        return self._partitions.pop(tp, None)

    def assigned(self) -> frozenset[TopicPartition]:
        """The partitions currently tracked."""
        return frozenset(self._partitions)

    def get(self, tp: TopicPartition) -> PartitionOffsets | None:
        """The state of ``tp``, or None if not assigned."""
        return self._partitions.get(tp)

    def generation(self, tp: TopicPartition) -> int | None:
        """The current generation of ``tp``, or None if not assigned."""
        state = self._partitions.get(tp)
        return None if state is None else state.generation

    def track(self, tp: TopicPartition, offset: int) -> int:
        """Record a dispatched record; returns the generation to pass to ``done``.

        Raises KeyError if ``tp`` is not assigned: dispatching a record of a
        partition we do not own is a bug in the caller.
        """
        state = self._partitions.get(tp)
        if state is None:
            raise KeyError(f"track on unassigned partition {tp}")
        state.track(offset)
        return state.generation

    def done(self, tp: TopicPartition, offset: int, generation: int) -> bool:
        """Mark a record done; False (and nothing changes) if the completion is stale.

        Stale means ``tp`` is no longer assigned, or was re-assigned since the
        record was tracked. Raises ValueError if the record is not pending in
        the current generation (see ``PartitionOffsets.done``).
        """
        state = self._partitions.get(tp)
        if state is None or state.generation != generation:
            return False
        state.done(offset)
        return True

    def done_many(self, tp: TopicPartition, offsets: Iterable[int], generation: int) -> bool:
        """Mark several records of ``tp`` done at once; False (nothing changes) if stale."""
        state = self._partitions.get(tp)
        if state is None or state.generation != generation:
            return False
        state.done_many(offsets)
        return True

    def commit_point(self, tp: TopicPartition) -> int | None:
        """The commit point of ``tp``, or None if not assigned or nothing tracked."""
        state = self._partitions.get(tp)
        return None if state is None else state.commit_point()

    def commit_offsets(self) -> dict[TopicPartition, int]:
        """The commit point of every partition that advanced since the last mark_committed."""
        offsets: dict[TopicPartition, int] = {}
        for tp, state in self._partitions.items():
            point = state.commit_point()
            if point is None:
                continue
            committed = self._committed.get(tp)
            if committed is None or point > committed:
                offsets[tp] = point
        return offsets

    def mark_committed(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Record offsets the broker accepted; partitions no longer assigned are ignored."""
        for tp, offset in offsets.items():
            if tp not in self._partitions:
                continue
            previous = self._committed.get(tp)
            # A commit that finished late must not pull the mark backwards.
            self._committed[tp] = offset if previous is None else max(previous, offset)

    def pending(self, tp: TopicPartition | None = None) -> int:
        """Records tracked and not done, for ``tp`` or across all partitions."""
        if tp is not None:
            state = self._partitions.get(tp)
            return 0 if state is None else state.pending()
        return sum(state.pending() for state in self._partitions.values())

    def done_beyond_commit(self, tp: TopicPartition) -> list[int]:
        """The done offsets of ``tp`` above its commit point; [] if not assigned."""
        state = self._partitions.get(tp)
        return [] if state is None else state.done_beyond_commit()

    def progress(self) -> list[PartitionProgress]:
        """Every assigned partition's commit point, highest dispatched offset and done count."""
        return [
            PartitionProgress(
                tp.topic,
                tp.partition,
                state.commit_point(),
                state.last_tracked,
                state.done_beyond_count(),
            )
            for tp, state in self._partitions.items()
        ]
