"""An in-memory aiokafka transactional producer for the transactions and delivery unit tests.

What ``PartitionProducer`` uses of ``AIOKafkaProducer``, each call recorded, with the
failures a real broker cannot be made to produce on demand set per producer: a start
that fails, a message refused for size, offsets or a commit refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from worker.kafka.transactions import Message


class _TxnManager:
    def __init__(self) -> None:
        self.open = False

    def is_in_transaction(self) -> bool:
        return self.open


class _Builder:
    """A batch being filled (``create_batch``): its messages and their indexes."""

    def __init__(self, producer: FakeProducer) -> None:
        self._producer = producer
        self.messages: list[tuple[int, bytes | None, bytes | None, list[Any]]] = []
        self.closed = False

    def append(
        self, *, key: bytes | None, value: bytes | None, timestamp: None, headers: list[Any]
    ) -> object | None:
        """None when full: a message over the producer's own limit is, even alone."""
        index = self._producer.next_index()
        if index in self._producer.refuse_at_send:
            return None
        self.messages.append((index, value, key, headers))
        return object()

    def close(self) -> None:
        self.closed = True


class FakeProducer:
    """What PartitionProducer uses of AIOKafkaProducer, recording every call. Messages are
    numbered in the order they are handed over (``send``, or appended to a batch): the
    indexes ``refuse`` and ``refuse_at_send`` name."""

    def __init__(self) -> None:
        self._txn_manager = _TxnManager()
        self.calls: list[str] = []
        self.start_error: BaseException | None = None
        self.refuse: set[int] = set()  # indexes of messages refused for size
        #: Indexes of messages over the producer's own limit: ``send`` itself raises.
        self.refuse_at_send: set[int] = set()
        #: Called when a start is tried, and when a message is sent.
        self.on_start: Callable[[], None] = lambda: None
        self.on_send: Callable[[], None] = lambda: None
        self.offsets_error: BaseException | None = None
        self.commit_error: BaseException | None = None
        self.sent: list[Message] = []
        #: Batches handed over (``send_batch``): each one's message indexes.
        self.batches: list[list[int]] = []
        self._handed = 0
        self.offsets: list[dict[TopicPartition, OffsetAndMetadata]] = []
        #: Messages of the transactions that committed.
        self.committed: list[Message] = []
        self._pending: list[Message] = []

    async def start(self) -> None:
        self.calls.append("start")
        self.on_start()
        if self.start_error is not None:
            raise self.start_error

    async def stop(self) -> None:
        self.calls.append("stop")

    async def begin_transaction(self) -> None:
        self.calls.append("begin")
        self._txn_manager.open = True
        self._pending = []

    def next_index(self) -> int:
        index, self._handed = self._handed, self._handed + 1
        return index

    async def send(
        self, topic: str, value: bytes | None, key: bytes | None, headers: list[Any]
    ) -> asyncio.Future[None]:
        self.on_send()
        index = self.next_index()
        if index in self.refuse_at_send:
            self.sent.append((topic, value, key, headers))
            raise MessageSizeTooLargeError("over max_request_size")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if index in self.refuse:
            future.set_exception(MessageSizeTooLargeError())
        else:
            future.set_result(None)
        self.sent.append((topic, value, key, headers))
        self._pending.append((topic, value, key, headers))
        return future

    async def partitions_for(self, topic: str) -> set[int]:
        return {0}

    def create_batch(self) -> _Builder:
        return _Builder(self)

    async def send_batch(
        self, batch: _Builder, topic: str, *, partition: int
    ) -> asyncio.Future[None]:
        """The batch's acknowledgement: refused (for size) when any of its messages is."""
        assert batch.closed and partition == 0
        self.on_send()
        self.batches.append([index for index, *_ in batch.messages])
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if any(index in self.refuse for index, *_ in batch.messages):
            future.set_exception(MessageSizeTooLargeError())
        else:
            future.set_result(None)
        for _, value, key, headers in batch.messages:
            self.sent.append((topic, value, key, headers))
            self._pending.append((topic, value, key, headers))
        return future

    async def send_offsets_to_transaction(
        self, offsets: dict[TopicPartition, OffsetAndMetadata], group_id: str
    ) -> None:
        if self.offsets_error is not None:
            raise self.offsets_error
        self.offsets.append(offsets)

    async def commit_transaction(self) -> None:
        self.calls.append("commit")
        if self.commit_error is not None:
            raise self.commit_error
        self._txn_manager.open = False
        self.committed += self._pending

    async def abort_transaction(self) -> None:
        self.calls.append("abort")
        self._txn_manager.open = False


class Factory:
    """Hands out fake producers, set up in turn by ``prepare`` (the n-th one made)."""

    def __init__(
        self,
        transactional_id: str,
        prepare: Callable[[int, FakeProducer], None] = lambda _n, _p: None,
    ) -> None:
        self.made: list[FakeProducer] = []
        self._transactional_id = transactional_id
        self._prepare = prepare

    def __call__(self, transactional_id: str) -> AIOKafkaProducer:
        assert transactional_id == self._transactional_id
        producer = FakeProducer()
        self._prepare(len(self.made), producer)
        self.made.append(producer)
        return cast(AIOKafkaProducer, producer)
