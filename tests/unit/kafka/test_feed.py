"""The intakes' backlog: partitions take turns for window slots, each in its own order."""

from __future__ import annotations

from collections import Counter, deque
from types import SimpleNamespace
from typing import Any

from aiokafka.structs import ConsumerRecord, TopicPartition

from worker.flow.window import Window
from worker.kafka.feed import Feed

PARTITIONS = [TopicPartition("in", p) for p in range(4)]


def _feed(window: Window, dispatched: list[ConsumerRecord[bytes, bytes]]) -> Feed:
    """A feed of 100 fetched records on each of four partitions."""
    feed = Feed(
        window=window,
        breaker=SimpleNamespace(is_open=False),  # type: ignore[arg-type]
        metrics=None,  # type: ignore[arg-type]
    )
    # What run() is given: dispatch and admits (the listener is not used here).
    feed._dispatch = dispatched.extend
    feed._admits = lambda _tp: True
    backlog: dict[Any, Any] = feed._backlog
    for tp in PARTITIONS:
        backlog[tp] = deque(
            ConsumerRecord(tp.topic, tp.partition, o, 0, 0, b"k", b"v", None, 1, 1, [])
            for o in range(100)
        )
    return feed


def test_partitions_with_backlogs_share_the_window() -> None:
    """Four partitions' backlogs, a window of 8 with 4 per partition: 2 slots each, in order."""
    dispatched: list[ConsumerRecord[bytes, bytes]] = []
    _feed(Window(8, per_partition_limit=4), dispatched)._dispatch_backlog()
    assert Counter(r.partition for r in dispatched) == dict.fromkeys(range(4), 2)
    for p in range(4):
        assert [r.offset for r in dispatched if r.partition == p] == [0, 1]


def test_a_slot_freed_goes_to_each_partition_in_turn() -> None:
    """The window full, one slot freed at a time (the oldest record done): every partition
    gets some, where the first partition used to take every one (the others starved)."""
    window = Window(8, per_partition_limit=8)
    dispatched: list[ConsumerRecord[bytes, bytes]] = []
    feed = _feed(window, dispatched)
    feed._dispatch_backlog()
    served = []
    for done in range(8):
        oldest = dispatched[done]
        window.release(TopicPartition(oldest.topic, oldest.partition))
        before = len(dispatched)
        feed._dispatch_backlog()
        (record,) = dispatched[before:]
        served.append(record.partition)
    assert set(served) == {0, 1, 2, 3}
    for p in range(4):
        offsets = [r.offset for r in dispatched if r.partition == p]
        assert offsets == list(range(len(offsets)))  # each partition in its own order


def test_a_partition_with_nothing_fetched_is_starved_below_its_share() -> None:
    """The window full with three partitions' records: the fourth, with nothing fetched
    and nothing in flight, is starved (it must go on fetching); one with a backlog, or
    with its share in flight, is not."""
    window = Window(8, per_partition_limit=8)
    dispatched: list[ConsumerRecord[bytes, bytes]] = []
    feed = _feed(window, dispatched)
    feed._backlog[PARTITIONS[0]].clear()
    feed._dispatch_backlog()
    assert window.in_flight == 8 and window.in_flight_for(PARTITIONS[0]) == 0
    assert feed._starved(PARTITIONS[0], 4)
    assert not feed._starved(PARTITIONS[1], 4)  # a backlog
    feed._backlog[PARTITIONS[1]].clear()
    assert window.in_flight_for(PARTITIONS[1]) >= 2
    assert not feed._starved(PARTITIONS[1], 4)  # its share (8 / 4) in flight
