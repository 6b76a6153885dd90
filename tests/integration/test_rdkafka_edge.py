"""What only the librdkafka edge has to get right: records as librdkafka hands them over."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

import confluent_kafka
from aiokafka.structs import ConsumerRecord, TopicPartition

from devtools.devstack.process import free_port
from tests.support import KafkaUnderTest, TritonUnderTest
from tests.support.kafka import Topics, create
from tests.support.worker import settings_for
from worker.flow.breaker import CircuitBreaker
from worker.flow.window import Window
from worker.kafka.rdkafka import config as rdkafka_config
from worker.kafka.rdkafka.intake import RdIntake
from worker.observability import Metrics
from worker.settings import Settings

#: A backlog of eight prefetch queues' worth (librdkafka keeps 1,000 records per partition),
#: of records the size of a request: one fetch (1 MiB per partition) takes about 1,000.
_BACKLOG = 8000
_VALUE = b"x" * 1024
#: Longest the intake may go without handing a record over while a backlog waits: many
#: consume waits (20 ms), far below librdkafka's default prefetch backoff (1 s).
_MAX_PAUSE_S = 0.25


def _intake(
    settings: Settings, topics: list[str], window: Window, metrics: Metrics | None = None
) -> RdIntake:
    """The worker's librdkafka intake on ``topics``, alone: no delivery behind it."""
    return RdIntake(
        rdkafka_config.consumer_config(settings.kafka, settings.kafka_auth),
        topics,
        max_poll_records=settings.kafka.max_poll_records,
        window=window,
        breaker=CircuitBreaker(5),
        metrics=metrics or Metrics(),
    )


def _admit_all(_tp: TopicPartition) -> bool:
    """No delivery behind the intake: every partition may take records."""
    return True


class _NoListener:
    """Assignments and revocations heard and ignored (nothing is committed here)."""

    async def on_assigned(self, partitions: set[TopicPartition]) -> None:
        return None

    async def on_revoked(self, partitions: set[TopicPartition], *, lost: bool = False) -> None:
        return None


async def _backlog(kafka: KafkaUnderTest, unique: str, partitions: int = 1) -> Topics:
    """Fresh topics, ``_BACKLOG`` records waiting on the input's partitions, in turn."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=partitions)
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for i in range(_BACKLOG):
        producer.produce(topics.input, _VALUE, key=str(i).encode(), partition=i % partitions)
        if i % 1000 == 999:
            producer.poll(0)
    assert await asyncio.to_thread(producer.flush, 30) == 0
    return topics


def _releaser(window: Window) -> Callable[[list[ConsumerRecord[bytes, bytes]]], None]:
    """Gives the records' slots back: they are done."""

    def release(records: list[ConsumerRecord[bytes, bytes]]) -> None:
        for record in records:
            window.release(TopicPartition(record.topic, record.partition))

    return release


async def _run(
    intake: RdIntake,
    dispatch: Callable[[list[ConsumerRecord[bytes, bytes]]], None],
    until: asyncio.Event,
) -> None:
    """Start ``intake`` and run it, dispatching to ``dispatch``, until ``until`` is set."""
    await intake.start(_NoListener())
    running = asyncio.create_task(intake.run(dispatch, _admit_all))
    try:
        await asyncio.wait_for(until.wait(), 60)
    finally:
        intake.request_stop()
        await running
        await intake.stop()


async def _drain(
    intake: RdIntake,
    done: Callable[[list[ConsumerRecord[bytes, bytes]]], object],
    seen: Callable[[], None] = lambda: None,
) -> list[float]:
    """Run ``intake`` until it has handed the whole backlog over, each dispatch passed to
    ``done`` (which releases its slots) and followed by ``seen()``; when each was handed."""
    handed: list[float] = []
    count = 0
    drained = asyncio.Event()

    def dispatch(records: list[ConsumerRecord[bytes, bytes]]) -> None:
        nonlocal count
        handed.append(time.monotonic())
        count += len(records)
        done(records)
        seen()
        if count >= _BACKLOG:
            drained.set()

    await _run(intake, dispatch, drained)
    assert count == _BACKLOG
    return handed


def _longest_pause_s(handed: list[float]) -> float:
    longest_s = max(later - earlier for earlier, later in itertools.pairwise(handed))
    took_s = handed[-1] - handed[0]
    print(f"\n{_BACKLOG} records in {took_s:.2f} s, longest pause {longest_s:.3f} s")
    return longest_s


async def test_a_backlog_drains_without_waiting_out_the_prefetch_backoff(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """8,000 records wait on one partition, each done as it is dispatched: the intake never
    goes 250 ms without handing records over (librdkafka's 1 s prefetch backoff stalled it)."""
    topics = await _backlog(kafka, unique)
    settings = settings_for(kafka, triton, topics, kafka_client="confluent")
    # Room for more than a poll: the intake never pauses the partition, so only librdkafka's
    # prefetch sets the pace.
    window = Window(1000, 1000)
    # Each record done at once: only the intake sets the pace.
    handed = await _drain(_intake(settings, [topics.input], window), _releaser(window))
    longest_s = _longest_pause_s(handed)
    assert longest_s < _MAX_PAUSE_S, f"the intake stood still for {longest_s:.2f} s"


async def test_a_window_smaller_than_a_poll_keeps_the_backlog_within_a_poll_unpaused(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """8,000 records wait on one partition; the window (64) is far below a poll (500) and
    each record is done on the loop's next turn, so the window is full at every fetch: the
    intake takes only what keeps its backlog within a poll, the partition is never paused,
    and the intake never goes 250 ms without handing records over. (It took a whole poll
    at every fetch: the backlog passed the pause bound, librdkafka dropped the partition's
    prefetch and fetched again only about 0.5 s after the resume, in every cycle.)"""
    topics = await _backlog(kafka, unique)
    settings = settings_for(kafka, triton, topics, kafka_client="confluent")
    assert settings.kafka.max_poll_records == 500
    window = Window(64, 64)
    loop = asyncio.get_running_loop()
    metrics = Metrics()
    intake = _intake(settings, [topics.input], window, metrics)
    paused: list[float] = []
    release = _releaser(window)

    def seen() -> None:
        paused.append(metrics.registry.get_sample_value("worker_paused_partitions") or 0)

    handed = await _drain(intake, lambda records: loop.call_soon(release, records), seen)
    longest_s = _longest_pause_s(handed)
    assert max(paused) == 0, "a partition was paused while the window was full"
    assert longest_s < _MAX_PAUSE_S, f"the intake stood still for {longest_s:.2f} s"


async def test_a_partition_stuck_in_the_window_leaves_the_others_a_whole_poll(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Two partitions of 4,000 records; the first one's records are never done (its 32
    slots stay taken), the second's are done on the loop's next turn: the first is paused
    once its backlog holds a poll, and the second's records come many to a hand-over (up
    to its 32 slots). A fetch budget that counted the paused partition's
    backlog left the others a record or two a fetch (about 2,000 hand-overs)."""
    topics = await _backlog(kafka, unique, partitions=2)
    settings = settings_for(kafka, triton, topics, kafka_client="confluent")
    window = Window(64, 32)
    loop = asyncio.get_running_loop()
    intake = _intake(settings, [topics.input], window)
    handed: list[float] = []
    drained = asyncio.Event()
    flowing = 0
    release = _releaser(window)

    def dispatch(records: list[ConsumerRecord[bytes, bytes]]) -> None:
        nonlocal flowing
        moving = [r for r in records if r.partition == 1]
        if moving:
            handed.append(time.monotonic())
            flowing += len(moving)
            loop.call_soon(release, moving)
        if flowing >= _BACKLOG // 2:
            drained.set()

    await _run(intake, dispatch, drained)
    per_hand_over = flowing / len(handed)
    print(f"\n{flowing} records of the flowing partition in {len(handed)} hand-overs")
    assert per_hand_over >= 8, f"{per_hand_over:.1f} records a hand-over: starved of fetches"


async def test_a_broker_that_cannot_be_reached_is_reported_and_the_intake_goes_on(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """No broker at the bootstrap address: librdkafka's error report is logged, and the fetch
    loop carries on until asked to stop (each report raised TypeError out of consume)."""
    topics = Topics.fresh(unique)
    address = f"127.0.0.1:{free_port()}"
    settings = settings_for(
        kafka, triton, topics, kafka_client="confluent", bootstrap_servers=address
    )
    loop = asyncio.get_running_loop()
    reported = asyncio.Event()

    class Heard(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            detail = str(getattr(record, "detail", ""))
            if record.getMessage() == "kafka_client_error" and address in detail:
                loop.call_soon_threadsafe(reported.set)

    heard = Heard()
    rd_logger = logging.getLogger("librdkafka")
    # An in-process `check` of an earlier test quiets this logger (the command's own process
    # ends after its table): the reports are heard at the level the worker logs them.
    level = rd_logger.level
    rd_logger.setLevel(logging.WARNING)
    rd_logger.addHandler(heard)
    intake = _intake(settings, [topics.input], Window(4, 4))
    await intake.start(_NoListener())
    running = asyncio.create_task(intake.run(lambda _: None, _admit_all))
    try:
        await asyncio.wait_for(reported.wait(), 30)
    finally:
        rd_logger.removeHandler(heard)
        rd_logger.setLevel(level)
        intake.request_stop()
        await running  # ends as asked, not with the consume that heard the report
        await intake.stop()
