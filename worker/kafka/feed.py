"""What both intakes share: a backlog per partition fed to ``dispatch``, and the refusals.

Records go to ``dispatch`` as the window and delivery admit them; a group or topic the
broker refuses ends the worker.

Each client's intake (``aiokafka/intake.py``, ``rdkafka/intake.py``) fetches into the
backlog; the feed decides which records go, partitions taking turns for window slots.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

from aiokafka.structs import ConsumerRecord, TopicPartition

from worker.errors import CannotRun
from worker.flow.breaker import CircuitBreaker
from worker.flow.window import Window
from worker.observability import Metrics

__all__ = ["REFUSED_CODES", "Admits", "Dispatch", "Feed", "Rebalance", "refused"]

#: Called with the records given a window slot in one pass, in offset order per partition.
Dispatch = Callable[[list[ConsumerRecord[bytes, bytes]]], None]
#: False while a partition may not run further past its commit point (delivery's bound).
Admits = Callable[[TopicPartition], bool]

#: Kafka's codes of a group, or a topic, refused to the client.
GROUP_AUTHORIZATION_FAILED, TOPIC_AUTHORIZATION_FAILED = 30, 29
REFUSED_CODES = frozenset({GROUP_AUTHORIZATION_FAILED, TOPIC_AUTHORIZATION_FAILED})


def refused(code: int, group_id: str, topics: Sequence[str], reason: str) -> CannotRun:
    """The error ending the worker (exit 2) when the broker refuses it its group or its
    input topics while it runs (ACLs changed since the start-up check)."""
    if code == GROUP_AUTHORIZATION_FAILED:
        return CannotRun(
            f"Kafka refused consumer group {group_id!r} to the worker ({reason}): grant its "
            "principal Describe and Read on the group, or change WORKER_GROUP_ID"
        )
    return CannotRun(
        f"Kafka refused the input topics {', '.join(topics)} to the worker ({reason}): "
        "grant its principal Describe and Read on them"
    )


class Rebalance(Protocol):
    """Told of assignment changes; the intake has already stopped dispatching revoked ones."""

    async def on_revoked(self, partitions: set[TopicPartition], *, lost: bool = False) -> None:
        """``lost``: the session expired and the group has moved on; nothing of them can be
        committed any more."""

    async def on_assigned(self, partitions: set[TopicPartition]) -> None: ...


class Feed:
    """What both intakes share: fetched records wait in a backlog per partition and go to
    ``dispatch`` once delivery admits them and they hold a window slot.

    The listener is given to ``start`` (it is told of assignments from the subscription
    on, and of the revocation ``stop`` makes), ``dispatch`` and ``admits`` to ``run``.
    """

    _rebalance: Rebalance
    _dispatch: Dispatch
    _admits: Admits

    def __init__(self, *, window: Window, breaker: CircuitBreaker, metrics: Metrics) -> None:
        self._window = window
        self._metrics = metrics
        self._breaker = breaker
        self._backlog: dict[TopicPartition, deque[ConsumerRecord[bytes, bytes]]] = {}
        self._turn = 0  # which partition with a backlog goes first next time
        self._stopping = asyncio.Event()
        self.running = False

    def request_stop(self) -> None:
        """Stop fetching and dispatching; in-flight records carry on."""
        self._stopping.set()

    def _dispatch_backlog(self) -> None:
        """Dispatch the backlog's records that delivery admits and that get a slot: each
        partition's in order, the partitions taking turns one record at a time from a
        starting partition that moves on every call.

        Taking each partition's backlog whole, always in the same order, let the first
        partitions refill the window every time it freed (two at their per-partition
        limit fill it), so that a partition behind them got no slot for as long as they
        had a backlog (under exactly_once, whose records hold their slots until their
        transaction commits, a final worker draining 6,000 records left two of four
        partitions uncommitted for more than 10 s).
        """
        if self._breaker.is_open:
            return  # Triton is out: records stay in the backlog and in Kafka.
        order = [tp for tp, queue in self._backlog.items() if queue]
        if not order:
            return
        start = self._turn % len(order)
        self._turn += 1
        turn = order[start:] + order[:start]
        taken: list[ConsumerRecord[bytes, bytes]] = []
        while turn:
            turn = [tp for tp in turn if self._take_one(tp, taken)]
        if taken:
            self._dispatch(taken)  # together: the worker may handle them as one batch

    def _take_one(self, tp: TopicPartition, taken: list[ConsumerRecord[bytes, bytes]]) -> bool:
        """Move ``tp``'s next record to ``taken`` if it may go; True if ``tp`` has more."""
        queue = self._backlog[tp]
        if not (self._admits(tp) and self._window.try_acquire(tp)):
            return False
        taken.append(queue.popleft())
        return bool(queue)

    def _can_take(self, tp: TopicPartition) -> bool:
        """A record of ``tp`` could be dispatched now: a slot is free and delivery admits it."""
        return not self._window.full_for(tp) and self._admits(tp)

    def _starved(self, tp: TopicPartition, assigned: int) -> bool:
        """``tp`` has nothing fetched and less than its share of the window in flight.

        Such a partition must go on fetching while the window is full: were it paused
        then, the partitions that have a backlog would take every slot as it frees, before
        it could fetch, for as long as they have one (under exactly_once, a worker
        draining a backlog left one partition of four without a commit for over 10 s).
        """
        share = max(1, self._window.limit // max(1, assigned))
        return not self._backlog.get(tp) and self._window.in_flight_for(tp) < share

    def _room(self, partitions: set[TopicPartition]) -> Coroutine[Any, Any, object]:
        """Returns once one of ``partitions`` can take a record (or the breaker closes)."""
        if self._breaker.is_open:
            return self._breaker.wait_closed()
        return self._window.wait_until(lambda: any(self._can_take(tp) for tp in partitions))
