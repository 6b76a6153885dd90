"""What the soak reads back: every result and dead letter, and the tripwire that ends it early."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from tests.support import Topics
from tests.support.soak.avro import AVRO_ENCODING, AvroResult, check_avro
from tests.support.soak.checks import (
    MlpCheck,
    check_result,
    cut_short,
    first_header,
    running_sum_of,
)
from tests.support.soak.events import EVENT_ENCODINGS, check_event
from tests.support.soak.lanes import Inputs, Ledger

_T = TypeVar("_T")
#: The dead letter a ``running_sum`` step may get once its sequence was disturbed: Triton
#: lost the sequence (restarted, the model reloaded, idle too long) or another server got it.
SEQUENCE_LOST = "INFERENCE_ERROR"


@dataclass(frozen=True, slots=True)
class Outcome:
    """One result or dead letter as read from the broker."""

    source: tuple[int, int]  # input (number, offset): Inputs numbers the input partitions
    rid: str
    code: str | None  # None for a result
    appended_ms: int  # the broker's LogAppendTime
    total: int | None = None  # a ``running_sum`` result's SUM


class Tripwire:
    """The first unexpected failure (a worker exiting by itself, a server dying, a partition
    stalled) ends the soak."""

    def __init__(self, context: Callable[[], str]) -> None:
        self._failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._context = context

    def trip(self, message: str) -> None:
        if not self._failed.done():
            self._failed.set_exception(AssertionError(message))

    def check(self) -> None:
        if self._failed.done():
            self._failed.result()

    async def guard(self, step: Awaitable[_T], timeout_s: float, what: str) -> _T:
        """Await ``step``; fail at once on a trip, or after ``timeout_s`` saying ``what``."""
        task = asyncio.ensure_future(step)
        waiting: set[asyncio.Future[Any]] = {task, self._failed}
        done, _ = await asyncio.wait(
            waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        self.check()
        raise AssertionError(f"{what}: not done within {timeout_s:.0f} s\n{self._context()}")


class Collector:
    """Reads results and dead letters (read_committed), once per (topic, partition, offset)."""

    def __init__(self, bootstrap: str, topics: Topics, inputs: Inputs, ledger: Ledger) -> None:
        self._bootstrap = bootstrap
        self._topics = topics
        self._inputs = inputs
        self._ledger = ledger
        self.outcomes: list[Outcome] = []
        self.by_source: dict[tuple[int, int], list[Outcome]] = {}
        self.problems: list[str] = []
        #: (request id, appended ms) of token streams answered with only their first tokens.
        self.cut_short: list[tuple[str, int]] = []
        self.mlp_checks: list[MlpCheck] = []
        #: The Avro topic's results, decoded once the run is over (``check_avro_results``).
        self.avro_results: list[AvroResult] = []
        self._seen: set[tuple[str, int, int]] = set()
        self._changed = asyncio.Event()
        self._positions: dict[TopicPartition, int] = {}

    async def run(self, stop: asyncio.Event) -> None:
        consumer = AIOKafkaConsumer(
            self._topics.output,
            self._topics.dlq,
            bootstrap_servers=self._bootstrap,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            isolation_level="read_committed",
            max_partition_fetch_bytes=4 << 20,
        )
        await consumer.start()
        try:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=200)
                for records in batch.values():
                    for record in records:
                        self._take(record)
                moved = False
                for tp in consumer.assignment():
                    # The position, not the last record's offset + 1: it passes the
                    # markers that end transactions (exactly_once), which hold offsets too.
                    position = await consumer.position(tp)
                    moved |= position != self._positions.get(tp)
                    self._positions[tp] = position
                if batch or moved:
                    self._changed.set()
        finally:
            await consumer.stop()

    def _take(self, record: ConsumerRecord[bytes, bytes]) -> None:
        position = (record.topic, record.partition, record.offset)
        if position in self._seen:
            return
        self._seen.add(position)
        headers = record.headers
        topic = (first_header(headers, "x-source-topic") or b"").decode(errors="replace")
        try:
            number = self._inputs.number(
                topic, int(first_header(headers, "x-source-partition") or b"")
            )
            source = (number, int(first_header(headers, "x-source-offset") or b""))
        except (KeyError, ValueError):
            self.problems.append(f"{position}: no x-source-topic/partition/offset of an input")
            return
        rid = (first_header(headers, "x-request-id") or b"").decode(errors="replace")
        is_result = record.topic == self._topics.output
        code = None if is_result else (first_header(headers, "x-error-code") or b"?").decode()
        wrong, total = self._judge(rid, record, code)
        if wrong is not None:
            self.problems.append(wrong)
        outcome = Outcome(source, rid, code, record.timestamp, total)
        self.outcomes.append(outcome)
        self.by_source.setdefault(source, []).append(outcome)

    def _judge(
        self, rid: str, record: ConsumerRecord[bytes, bytes], code: str | None
    ) -> tuple[str | None, int | None]:
        """What is wrong with an outcome for what was sent (or None), and a step's SUM."""
        sent = self._ledger.sent.get(rid)
        where = (record.topic, record.partition, record.offset)
        if sent is None:
            return f"{where}: request id {rid!r} was never sent", None
        if code is None and sent.expected_code is not None and not sent.result_allowed:
            return f"{rid} ({sent.kind}): a result, expected {sent.expected_code}", None
        if code is None and cut_short(sent, record):
            self.cut_short.append((rid, record.timestamp))
            return None, None
        if code is None:
            if sent.encoding == AVRO_ENCODING:
                wrong = check_avro(sent, record, self.avro_results)
            else:
                check = check_event if sent.encoding in EVENT_ENCODINGS else check_result
                wrong = check(sent, record, self.mlp_checks)
            if wrong:
                return f"{rid} ({sent.kind}, {sent.encoding}): {wrong}", None
            return None, running_sum_of(record) if sent.sequence else None
        if code != sent.expected_code and not (sent.sequence and code == SEQUENCE_LOST):
            message = first_header(record.headers, "x-error-message") or b""
            want = sent.expected_code or "a result"
            return f"{rid} ({sent.kind}): dead letter {code}, want {want}: {message!r}", None
        return None, None

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds, re-checked after every batch read."""
        while not predicate():
            self._changed.clear()
            await self._changed.wait()

    def read_up_to(self, ends: Mapping[TopicPartition, int]) -> bool:
        """True once every partition was read up to its end offset in ``ends``."""
        return all(self._positions.get(tp, 0) >= end for tp, end in ends.items() if end > 0)
