"""The consumer as the delivery modes see it, and the records they are given.

One ``Edge`` for every mode's unit tests: what a mode must never ask of the consumer
(a commit outside a transaction, a read of the committed offsets on librdkafka, a seek)
fails the test, as each test's settings say.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from aiokafka.errors import CommitFailedError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition

from worker.delivery.base import Delivery
from worker.kafka.transactions import Message, TransactionDeferred, TransactionFailed

TP = TopicPartition("in", 0)


def ours(point: int, runs: str) -> str:
    """The commit metadata a worker writes for ``runs`` (its own hex notation) at ``point``:
    the frame and the check, computed here on their own."""
    return f"d2:{runs};{zlib.crc32(f'{point}:{runs}'.encode()):08x}"


class Edge:
    """A consumer with ``partitions`` assigned and owned, their log ends at ``highwater``.

    ``committed``: offsets already committed; commits are recorded (and fail once with
    ``fail_next``), or refused with ``transactions_only`` (exactly_once commits in its
    transactions). ``fetches=False``: reading the committed offsets fails the test
    (librdkafka fetches from the stable committed offsets). Seeking always does.
    """

    def __init__(
        self,
        partitions: Iterable[TopicPartition] = (TP,),
        *,
        highwater: int | None = None,
        committed: Mapping[TopicPartition, OffsetAndMetadata] | None = None,
        transactions_only: bool = False,
        fetches: bool = True,
    ) -> None:
        self.partitions = set(partitions)
        self._highwater = highwater
        self.committed = dict(committed or {})
        self._transactions_only = transactions_only
        self._fetches = fetches
        self.commits: list[dict[TopicPartition, int]] = []
        self.metadata: list[dict[TopicPartition, str]] = []
        self.fail_next = False
        self.metadata_error: Exception | None = None

    def assignment(self) -> set[TopicPartition]:
        return set(self.partitions)

    def highwater(self, tp: TopicPartition) -> int | None:
        return self._highwater

    def owns(self, tp: TopicPartition) -> bool:
        return True

    async def commit(self, offsets: Mapping[TopicPartition, OffsetAndMetadata]) -> None:
        if self._transactions_only:
            raise AssertionError("exactly_once commits in transactions")
        if self.fail_next:
            self.fail_next = False
            raise CommitFailedError("rebalancing")
        self.commits.append({tp: meta.offset for tp, meta in offsets.items()})
        self.metadata.append({tp: meta.metadata for tp, meta in offsets.items()})

    async def fetch_committed(
        self, partitions: Iterable[TopicPartition]
    ) -> dict[TopicPartition, OffsetAndMetadata]:
        if not self._fetches:
            raise AssertionError("librdkafka fetches from the stable committed offsets")
        return {tp: self.committed[tp] for tp in partitions if tp in self.committed}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        raise AssertionError(f"no seek ({tp} to {offset})")

    async def group_metadata(self) -> Any:
        """librdkafka's group metadata (or the error of a rebalance beginning)."""
        if self.metadata_error is not None:
            raise self.metadata_error
        return "generation-7"


def record(offset: int, tp: TopicPartition = TP) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(tp.topic, tp.partition, offset, 0, 0, b"k", b"v", None, 1, 1, [])


async def completing(
    delivery: Delivery, rec: ConsumerRecord[bytes, bytes], deliver: Callable[[], Awaitable[None]]
) -> asyncio.Task[None]:
    """Dispatch the record and complete it through ``deliver``; returns once its outcome
    is staged (the task ends when the transaction carrying it commits), or raises what
    ended the record before that."""
    ticket = delivery.track(rec)
    staged = asyncio.Event()
    task = asyncio.create_task(delivery.complete(rec, ticket, deliver, staged.set))
    waiting = asyncio.create_task(staged.wait())
    await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    if task.done():
        task.result()  # raises what ended the record before it was staged
    return task


class Transactional:
    """A transactional producer in memory (``TransactionalProducer``), shared by every
    partition as librdkafka's is; each transaction ends as the next of ``endings`` says
    (``"fenced"``, ``"failed"``, or the indexes refused for size), committed once they
    run out. ``defer``: transactions cannot begin (a rebalance under way)."""

    transactional_id = "kafka-triton-worker-group-member-0"
    exact_refusals = False

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.running = False
        self.starts = 0
        self.abandoned = 0
        self.defer = False
        self.endings: list[str | tuple[int, ...]] = []
        #: Per transaction begun: its messages, offsets and whether sent one by one.
        self.sent: list[tuple[list[Message], dict[TopicPartition, int], bool]] = []

    async def start(self, still_ours: Callable[[], bool] = lambda: True) -> bool:
        if not still_ours():
            return False
        self.starts += 1
        self.running = True
        return True

    async def begin(self) -> None:
        if self.defer:
            raise TransactionDeferred("rebalance in progress")

    async def send(self, messages: Sequence[Message], *, one_by_one: bool) -> tuple[int, ...]:
        self.sent.append((list(messages), {}, one_by_one))
        ending = self.endings[0] if self.endings else None
        if isinstance(ending, tuple):
            self.endings.pop(0)
            return ending
        return ()

    async def send_offsets(self, offsets: Mapping[TopicPartition, int]) -> None:
        self.sent[-1][1].update(offsets)

    async def commit(self) -> None:
        ending = self.endings.pop(0) if self.endings else None
        if ending is not None:
            raise TransactionFailed(str(ending), fenced=ending == "fenced")

    async def abandon(self, why: str) -> None:
        self.abandoned += 1
        self.running = False

    async def stop(self) -> None:
        self.running = False


class Shared:
    """``Transactions`` of one shared producer, as on librdkafka (no seek after assignment)."""

    seeks_committed = False
    shared = True
    start_fences = False

    def __init__(self, producer: Transactional | None = None) -> None:
        self.producer = producer or Transactional()

    def producer_for(self, tp: TopicPartition) -> Transactional:
        return self.producer
