"""Reading a dead-letter topic up to a snapshot, and re-producing the selected dead letters.

The dead-letter topic is read up to the end offsets it has when the command starts
(``read_committed``), so the command ends even when replayed records fail again and
land behind that snapshot. It is read twice: once to judge every dead letter
(`worker.replay.plan`), once to send the selected ones, so that memory holds what the
dead letters say, not their values. Each is re-produced with its value, key and
headers, less those the worker added (``x-error-*``, ``x-source-*``, ...), plus
``x-replayed-from`` and ``x-replay-count``, by an idempotent producer (``acks=all``)
that waits for every ack. Records the broker refused are tried once more, one at a
time, each on a producer that has not failed: a refused batch takes its innocent
neighbours with it, and a size refusal leaves an idempotent producer unable to write
to that partition again. Destinations are looked up without creating topics.

Every client is the chosen library's (``WORKER_KAFKA_CLIENT``), built by the Kafka edge:
its admin answers what the topics are, its group-less reader reads the dead letters and
its idempotent writer sends them.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from typing import Any

from rich.progress import Progress, TaskID

from worker.checks import probes
from worker.commands.session import contact, describe
from worker.kafka import PRODUCER_HEADROOM_BYTES
from worker.kafka.direct import Reader, Writer
from worker.kafka.edge import new_reader, new_writer
from worker.kafka.types import ConsumerRecord, KafkaError, TopicPartition
from worker.replay.plan import DeadLetter, Entry, Outcome, Planner, ReplayPlan
from worker.settings import KafkaAuthSettings, KafkaSettings
from worker.wire import replay_headers

__all__ = ["ReplayError", "replay"]

#: Reading stops with an error when no partition moves for this long (a broker gone).
_STALL_S = 60.0
_KAFKA_ERRORS = {3: "does not exist", 29: "not authorized to describe it"}


#: Makes one of the replay's producers (not started).
_WriterFactory = Callable[[], Writer]


class ReplayError(Exception):
    """The dead-letter topic cannot be read: nothing was sent."""


async def replay(
    planner: Planner,
    kafka: KafkaSettings,
    auth: KafkaAuthSettings,
    progress: Progress | None = None,
) -> ReplayPlan:
    """Judge the snapshot's dead letters, then (unless a dry run) send the selected ones.

    Returns the plan with every entry's outcome; raises ReplayError when the
    dead-letter topic cannot be read, CommandFailed when a handshake is refused (CONFIG)
    or no broker answers (UNAVAILABLE), ConfigError for unusable security settings.
    """
    dlq_topic = planner.dlq_topic
    partitions = await _partitions(kafka, auth, dlq_topic)
    reader = new_reader(kafka, auth, suffix="replay")
    try:
        await reader.start()
    except KafkaError as exc:
        raise ReplayError(f"Kafka {kafka.bootstrap_servers}: {probes.reason(exc)}") from None
    try:
        try:
            spans = await reader.offsets(partitions)
            ranges = {tp: spans[tp] for tp in sorted(partitions)}
            async for record in _read(reader, ranges, progress, f"reading {dlq_topic}"):
                planner.add(DeadLetter.of(record))
        except KafkaError as exc:
            raise ReplayError(f"reading {dlq_topic!r}: {probes.reason(exc)}") from None
        plan = planner.plan()
        await _check_destinations(kafka, auth, plan)
        if not plan.dry_run and plan.having(Outcome.SEND):
            await _send(reader, plan, _new_writer(kafka, auth, plan), progress)
        return plan
    finally:
        await reader.stop()


async def _partitions(
    kafka: KafkaSettings, auth: KafkaAuthSettings, topic: str
) -> list[TopicPartition]:
    """The partitions of the dead-letter topic; ReplayError when it cannot be read."""
    async with contact(kafka, auth) as admin:
        answer = await describe(admin, [topic])
    by_name: dict[str, Any] = {t["topic"]: t for t in answer["topics"]}
    found = by_name.get(topic, {"error_code": 3})
    code = int(found["error_code"])
    if code:
        reason = _KAFKA_ERRORS.get(code, f"Kafka error code {code}")
        raise ReplayError(f"dead-letter topic {topic!r} {reason}")
    if probes.may(int(found["topic_authorized_operations"]), probes.READ) is False:
        raise ReplayError(f"dead-letter topic {topic!r}: no read permission")
    return [TopicPartition(topic, p["partition"]) for p in found["partitions"]]


async def _read(
    reader: Reader,
    ranges: dict[TopicPartition, range],
    progress: Progress | None,
    description: str,
) -> AsyncIterator[ConsumerRecord[bytes, bytes]]:
    """Every record inside ``ranges``; ends when each partition's position reaches its end."""
    pending = {tp: span for tp, span in ranges.items() if span}
    total = sum(len(span) for span in pending.values())
    task = progress.add_task(description, total=total) if progress is not None else None
    await reader.assign({tp: span.start for tp, span in pending.items()})
    positions: dict[TopicPartition, int] = {}
    moved_at = time.monotonic()
    while pending:
        read = 0
        # A short wait: a partition ending in a transaction marker reaches its end with
        # no record to return.
        for record in await reader.fetch(0.1):
            wanted = pending.get(TopicPartition(record.topic, record.partition), range(0))
            if record.offset in wanted:
                read += 1
                yield record
        if progress is not None and task is not None:
            progress.advance(task, read)
        now_at = {tp: await reader.position(tp) for tp in pending}
        # Control records and aborted transactions move the position without a record.
        if now_at != positions:
            positions, moved_at = now_at, time.monotonic()
        for tp, position in now_at.items():
            if position >= pending[tp].stop:
                del pending[tp]
        if pending and time.monotonic() - moved_at > _STALL_S:
            raise ReplayError(f"no progress reading {sorted(map(str, pending))} for {_STALL_S} s")
    if progress is not None and task is not None:
        progress.update(task, completed=total)


async def _check_destinations(
    kafka: KafkaSettings, auth: KafkaAuthSettings, plan: ReplayPlan
) -> None:
    """Entries whose topic does not exist (or may not be written) get NO_DESTINATION."""
    sending = plan.having(Outcome.SEND)
    topics = sorted({entry.destination for entry in sending})
    if not topics:
        return
    async with contact(kafka, auth) as admin:
        answer = await describe(admin, topics)
    problems: dict[str, str] = {}
    for found in answer["topics"]:
        code = int(found["error_code"])
        if code:
            problems[found["topic"]] = _KAFKA_ERRORS.get(code, f"Kafka error code {code}")
        elif probes.may(int(found["topic_authorized_operations"]), probes.WRITE) is False:
            problems[found["topic"]] = "no write permission"
    for entry in sending:
        if entry.destination in problems:
            entry.outcome = Outcome.NO_DESTINATION
            entry.detail = f"topic {entry.destination!r} {problems[entry.destination]}"


def _new_writer(kafka: KafkaSettings, auth: KafkaAuthSettings, plan: ReplayPlan) -> _WriterFactory:
    """Makes the idempotent producers of the replay, sized for its largest dead letter."""
    largest = max(entry.letter.size for entry in plan.having(Outcome.SEND))
    max_request = max(1 << 20, largest + PRODUCER_HEADROOM_BYTES)
    return functools.partial(
        new_writer, kafka, auth, suffix="replay", max_request_bytes=max_request
    )


def _outgoing(entry: Entry, record: Any) -> tuple[Any, ...]:
    headers = replay_headers(record.headers, entry.letter.at, entry.letter.replay_count + 1)
    return entry.destination, record.value, record.key, headers


async def _send(
    reader: Reader,
    plan: ReplayPlan,
    new_producer: _WriterFactory,
    progress: Progress | None,
) -> None:
    """Re-produce every SEND entry; each ends SENT or FAILED."""
    todo = {(e.letter.partition, e.letter.offset): e for e in plan.having(Outcome.SEND)}
    task = _progress_task(progress, todo.values())

    def settle(entry: Entry, error: BaseException | None) -> None:
        entry.outcome = Outcome.SENT if error is None else Outcome.FAILED
        entry.detail = "" if error is None else probes.reason(error)
        if progress is not None and task is not None and error is None:
            progress.advance(task)

    ranges = _ranges(plan.dlq_topic, todo)
    retry: list[tuple[Entry, Any]] = []
    inflight: dict[asyncio.Future[Any], tuple[Entry, Any]] = {}

    def acked(future: asyncio.Future[Any]) -> None:
        entry, record = inflight.pop(future)
        error = asyncio.CancelledError() if future.cancelled() else future.exception()
        if error is not None:
            retry.append((entry, record))
        settle(entry, error)

    lost = "no longer in the dead-letter topic (deleted by retention since it was read)"
    producer = new_producer()
    try:
        await producer.start()
    except KafkaError as exc:
        await producer.stop()
        for entry in todo.values():
            settle(entry, exc)
        return
    try:
        async for record in _read(reader, dict(sorted(ranges.items())), None, ""):
            selected = todo.pop((record.partition, record.offset), None)
            if selected is None:
                continue
            topic, value, key, headers = _outgoing(selected, record)
            try:
                future = await producer.send(topic, value, key, headers)
            except KafkaError as exc:
                retry.append((selected, record))
                settle(selected, exc)
                continue
            inflight[future] = (selected, record)
            future.add_done_callback(acked)
    except (KafkaError, ReplayError) as exc:
        lost = f"not read again: {probes.reason(exc)}"
    finally:
        await asyncio.gather(*list(inflight), return_exceptions=True)
        await producer.stop()
    for entry in todo.values():
        settle(entry, ReplayError(lost))
    await _send_again(retry, new_producer, settle)


def _progress_task(progress: Progress | None, entries: Collection[Entry]) -> TaskID | None:
    """The progress bar's task of the replay (None without a progress bar)."""
    if progress is None:
        return None
    destinations = ", ".join(sorted({e.destination for e in entries}))
    return progress.add_task(f"replaying to {destinations}", total=len(entries))


def _ranges(topic: str, todo: Iterable[tuple[int, int]]) -> dict[TopicPartition, range]:
    """The offsets to read again, as one range per partition of ``topic``."""
    ranges: dict[TopicPartition, range] = {}
    for partition, offset in todo:
        tp = TopicPartition(topic, partition)
        span = ranges.get(tp, range(offset, offset + 1))
        ranges[tp] = range(min(span.start, offset), max(span.stop, offset + 1))
    return ranges


async def _send_again(
    retry: Sequence[tuple[Entry, Any]],
    new_producer: _WriterFactory,
    settle: Callable[[Entry, BaseException | None], None],
) -> None:
    """Each refused record once more, alone, on a producer that has not failed yet."""
    producer: Writer | None = None
    try:
        for entry, record in retry:
            if producer is None:
                producer = new_producer()
                await producer.start()
            topic, value, key, headers = _outgoing(entry, record)
            try:
                await (await producer.send(topic, value, key, headers))
            except KafkaError as exc:
                settle(entry, exc)
                await producer.stop()
                producer = None
            else:
                settle(entry, None)
    finally:
        if producer is not None:
            await producer.stop()
