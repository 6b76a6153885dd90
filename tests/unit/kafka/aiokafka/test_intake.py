"""The aiokafka intake's pauses: which partitions fetch while the window is full.

The consumer is an in-memory fake of what the pause logic reads and calls (assignment,
paused, pause, resume): a real broker cannot be made to hold a window full at a chosen
moment. The intake against a real broker is in tests/integration.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from aiokafka.structs import ConsumerRecord, TopicPartition

from worker.flow.window import Window
from worker.kafka.aiokafka.intake import Intake, terminated, unterminated
from worker.observability import Metrics
from worker.settings import load_settings

PARTITIONS = [TopicPartition("in", p) for p in range(4)]
SETTINGS = load_settings(
    {"WORKER_INPUT_TOPICS": "in", "WORKER_OUTPUT_TOPIC": "out", "WORKER_DLQ_TOPIC": "dlq"}
)


class Consumer:
    """Four partitions assigned; pauses and resumes recorded."""

    def __init__(self) -> None:
        self._paused: set[TopicPartition] = set()

    def assignment(self) -> set[TopicPartition]:
        return set(PARTITIONS)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    def pause(self, *partitions: TopicPartition) -> None:
        self._paused.update(partitions)

    def resume(self, *partitions: TopicPartition) -> None:
        self._paused.difference_update(partitions)


def _record(tp: TopicPartition, offset: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(tp.topic, tp.partition, offset, 0, 0, b"k", b"v", None, 1, 1, [])


async def test_a_starved_partition_fetches_while_the_window_is_full() -> None:
    """Three partitions fill the window and keep a backlog; the fourth has nothing fetched
    and nothing in flight. It stays resumed (it used to be paused until a slot was free
    as the loop ran, which the others' backlogs always took first); the others pause."""
    window = Window(8, per_partition_limit=8)
    intake = Intake(
        SETTINGS.kafka,
        ["in"],
        client_kwargs={},
        window=window,
        breaker=SimpleNamespace(is_open=False),  # type: ignore[arg-type]
        metrics=Metrics(version="test"),
    )
    await intake.consumer.stop()  # never started: the fake takes its place
    consumer = Consumer()
    intake.consumer = consumer  # the consumer is typed Any (aiokafka has no stubs)
    intake._admits = lambda _tp: True
    for tp in PARTITIONS[1:]:
        intake._backlog[tp] = deque(_record(tp, o) for o in range(10))
    intake._dispatch = lambda records: None
    intake._dispatch_backlog()
    assert window.in_flight == 8 and window.in_flight_for(PARTITIONS[0]) == 0
    intake._sync_pauses()
    assert consumer.paused() == set(PARTITIONS[1:])
    # Once it has a backlog of its own it pauses too, and takes its turn for slots.
    intake._backlog[PARTITIONS[0]] = deque(_record(PARTITIONS[0], o) for o in range(10))
    intake._sync_pauses()
    assert consumer.paused() == set(PARTITIONS)
    window.release(PARTITIONS[1])
    taken: list[ConsumerRecord[bytes, bytes]] = []
    intake._dispatch = taken.extend
    for _ in range(3):
        intake._dispatch_backlog()
        (record,) = taken[-1:]
        window.release(TopicPartition(record.topic, record.partition))
    assert PARTITIONS[0].partition in {r.partition for r in taken}


def test_commit_metadata_is_written_and_read_with_librdkafka_s_terminator() -> None:
    """What the worker commits ends with the NUL librdkafka's binding writes (so that a
    worker on librdkafka reads it exactly), and reads back without it; empty stays empty."""
    assert terminated("d2:1+0;0badcafe") == "d2:1+0;0badcafe\x00"
    assert terminated("") == ""
    assert unterminated("d2:1+0;0badcafe\x00") == "d2:1+0;0badcafe"
    assert unterminated("\x00") == unterminated(None) == unterminated("") == ""
    assert unterminated("another tool's\x00\x00") == "another tool's\x00"
