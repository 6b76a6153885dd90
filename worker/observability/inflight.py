"""Records in flight: where each one is (state, age), the oldest, the stuck ones, per partition.

Every record holding a window slot has an ``InFlight`` entry, added when it takes
its slot (its task starts, or the fast path takes it) and removed when it ends; a
record the fast path hands to the per-record path keeps its entry, and its age. The
stages it passes through write its ``state`` (a few attribute writes per record:
the hot path stays cheap). Everything else is computed when asked: the age of the
oldest record for the gauge at scrape time, the ``/debug/inflight`` snapshot, and
a check every few seconds that logs ``record_stuck`` once per record in flight
longer than ``stuck_after_s``.

Entries are kept in insertion order, which is the order of their ``since``
(a monotonic reading taken at insertion): the oldest is the first. Each entry has a
key of its own, not its record's offset: a partition re-assigned to this member while
an earlier task of the same offset still runs has two entries, and removing one never
moves the other.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Final, Literal, Protocol

import structlog

__all__ = [
    "DETACHED",
    "MAX_LIMIT",
    "STATES",
    "Coordinates",
    "InFlight",
    "InFlightRegistry",
    "PartitionProgress",
    "State",
]

log = structlog.get_logger(__name__)

State = Literal[
    "decoding",
    "waiting_turn",
    "waiting_batch",
    "sent",
    "retrying",
    "held_outage",
    "held_model",
    "held_failing",
    "publishing",
    "waiting_commit",
]

#: Every state, in the order a record meets them; the snapshot counts each one.
STATES: Final[tuple[State, ...]] = (
    "decoding",  # decoding, validating, looking up the model
    "waiting_turn",  # waiting for an earlier record of its key or partition
    "waiting_batch",  # waiting for a micro-batch to fill
    "sent",  # sent to Triton, no answer yet
    "retrying",  # waiting for its next try after a retryable failure
    "held_outage",  # Triton unreachable (circuit breaker open): waiting for it
    "held_model",  # its model is being (re)loaded: waiting for it
    "held_failing",  # its model fails most requests (failure-rate breaker): waiting for a probe
    "publishing",  # outcome being written, waiting for the broker's ack
    "waiting_commit",  # outcome staged in a transaction that has not committed yet
)

#: Most records listed by one snapshot (the ``limit`` query parameter is capped to it).
MAX_LIMIT: Final = 1000


class InFlight:
    """One record in flight: its coordinates, since when, and where it is now."""

    __slots__ = (
        "attempt",
        "model",
        "next_try_at",
        "offset",
        "partition",
        "reported",
        "request_id",
        "since",
        "state",
        "topic",
    )

    def __init__(self, topic: str, partition: int, offset: int, since: float) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.since = since  # time.monotonic() when it took its slot
        self.state: State = "decoding"
        self.request_id: str | None = None
        self.model: str | None = None
        self.attempt = 1  # the try under way or next (failed tries + 1)
        self.next_try_at = 0.0  # monotonic time of the next try, while retrying
        self.reported = False  # record_stuck logged already

    def describe(self, now: float) -> dict[str, object]:
        """This record as plain data, its age taken at ``now`` (monotonic)."""
        out: dict[str, object] = {
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "request_id": self.request_id,
            "model": self.model,
            "state": self.state,
            "age_s": round(now - self.since, 3),
            "attempt": self.attempt,
        }
        if self.state == "retrying":
            out["next_try_in_s"] = round(max(0.0, self.next_try_at - now), 3)
        return out


#: Where the stages of a record not registered write (a handler driven without a
#: registry, as in unit tests): nothing reads it.
DETACHED: Final = InFlight("", -1, -1, 0.0)


class Coordinates(Protocol):
    """Where a record is: what ``add`` reads of a consumed record (either client's)."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def offset(self) -> int: ...


class PartitionProgress(Protocol):
    """One assigned partition's commit bookkeeping, as the delivery's offset tracker tells it."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def commit_point(self) -> int | None: ...

    @property
    def highest_dispatched(self) -> int | None: ...

    @property
    def done_beyond_commit(self) -> int: ...


class InFlightRegistry:
    """The entries of the records in flight, the oldest first."""

    def __init__(
        self,
        stuck_after_s: float,
        *,
        progress: Callable[[], Iterable[PartitionProgress]] = lambda: (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``progress`` lists the assigned partitions' commit bookkeeping (for snapshots)."""
        if stuck_after_s <= 0:
            raise ValueError(f"stuck_after_s must be > 0, got {stuck_after_s}")
        self.stuck_after_s = stuck_after_s
        # Often enough that a stuck record is told within a fraction of the bound,
        # rarely enough that the check costs nothing (it walks only the old entries).
        self.check_interval_s = min(5.0, max(0.05, stuck_after_s / 4))
        self._progress = progress
        self._clock = clock
        # Keyed by the entry itself: insertion order stays the order of ``since``.
        self._entries: dict[InFlight, None] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, record: Coordinates) -> InFlight:
        """Register a record taking its slot; returns the entry its stages update."""
        entry = InFlight(record.topic, record.partition, record.offset, self._clock())
        self._entries[entry] = None
        return entry

    def remove(self, entry: InFlight) -> None:
        """The record left its slot (done, abandoned or revoked). Idempotent."""
        self._entries.pop(entry, None)

    def oldest_age_s(self) -> float:
        """Seconds the oldest record has been in flight; 0 when none is (read at scrape time)."""
        for entry in self._entries:
            return max(0.0, self._clock() - entry.since)
        return 0.0

    def report_stuck(self) -> list[InFlight]:
        """Log ``record_stuck`` for each record in flight past the bound and not yet told."""
        now = self._clock()
        told = []
        for entry in self._entries:
            age_s = now - entry.since
            if age_s < self.stuck_after_s:
                break  # the rest are younger
            if entry.reported:
                continue
            entry.reported = True
            told.append(entry)
            log.warning(
                "record_stuck",
                topic=entry.topic,
                partition=entry.partition,
                offset=entry.offset,
                request_id=entry.request_id,
                model=entry.model,
                state=entry.state,
                attempt=entry.attempt,
                age_s=round(age_s, 3),
                stuck_after_s=self.stuck_after_s,
            )
        return told

    async def watch(self) -> None:
        """Report stuck records every ``check_interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.check_interval_s)
            self.report_stuck()

    def snapshot(self, limit: int = 20) -> dict[str, object]:
        """Counts by state, the ``limit`` oldest records and the partitions' commit points."""
        limit = max(1, min(limit, MAX_LIMIT))
        now = self._clock()
        entries = list(self._entries)
        by_state = dict.fromkeys(STATES, 0)
        in_flight_by_partition: dict[tuple[str, int], int] = {}
        for entry in entries:
            by_state[entry.state] += 1
            tp = (entry.topic, entry.partition)
            in_flight_by_partition[tp] = in_flight_by_partition.get(tp, 0) + 1
        partitions = [
            {
                "topic": p.topic,
                "partition": p.partition,
                "commit_point": p.commit_point,
                "highest_dispatched": p.highest_dispatched,
                "done_beyond_commit": p.done_beyond_commit,
                "in_flight": in_flight_by_partition.get((p.topic, p.partition), 0),
            }
            for p in sorted(self._progress(), key=lambda p: (p.topic, p.partition))
        ]
        return {
            "in_flight": len(entries),
            "oldest_age_s": round(max(0.0, now - entries[0].since), 3) if entries else 0.0,
            "stuck_after_s": self.stuck_after_s,
            "by_state": by_state,
            "oldest": [e.describe(now) for e in itertools.islice(entries, limit)],
            "partitions": partitions,
        }
