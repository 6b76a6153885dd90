"""One partition's transactional producer: start retries, fencing, a broken state machine,
a refusal for size.

The producer is an in-memory fake at the factory seam: a broker out of reach
during one assignment, an AssertionError from aiokafka's transaction state machine
and a refusal for size of one message inside a transaction cannot be produced on
demand by a real broker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    KafkaConnectionError,
    MessageSizeTooLargeError,
    ProducerFenced,
    TransactionalIdAuthorizationFailed,
)
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from worker.delivery import transactions
from worker.delivery.transactions import Message, PartitionProducer, ProducerStartFailed
from worker.flow.retry import Backoff

pytestmark = pytest.mark.timeout(10)

TP = TopicPartition("in", 3)
TXN_ID = "prefix-group-in-3"


class _TxnManager:
    def __init__(self) -> None:
        self.open = False

    def is_in_transaction(self) -> bool:
        return self.open


class FakeProducer:
    """What PartitionProducer uses of AIOKafkaProducer, recording every call."""

    def __init__(self) -> None:
        self._txn_manager = _TxnManager()
        self.calls: list[str] = []
        self.start_error: BaseException | None = None
        self.refuse: set[int] = set()  # indexes of messages refused for size
        self.commit_error: BaseException | None = None
        self.sent: list[Message] = []
        self.offsets: list[dict[TopicPartition, OffsetAndMetadata]] = []

    async def start(self) -> None:
        self.calls.append("start")
        if self.start_error is not None:
            raise self.start_error

    async def stop(self) -> None:
        self.calls.append("stop")

    async def begin_transaction(self) -> None:
        self.calls.append("begin")
        self._txn_manager.open = True

    async def send(
        self, topic: str, value: bytes | None, key: bytes | None, headers: list[Any]
    ) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if len(self.sent) in self.refuse:
            future.set_exception(MessageSizeTooLargeError())
        else:
            future.set_result(None)
        self.sent.append((topic, value, key, headers))
        return future

    async def send_offsets_to_transaction(
        self, offsets: dict[TopicPartition, OffsetAndMetadata], group_id: str
    ) -> None:
        self.offsets.append(offsets)

    async def commit_transaction(self) -> None:
        self.calls.append("commit")
        if self.commit_error is not None:
            raise self.commit_error
        self._txn_manager.open = False

    async def abort_transaction(self) -> None:
        self.calls.append("abort")
        self._txn_manager.open = False


class Factory:
    """Hands out fake producers, set up in turn by ``prepare`` (the n-th one made)."""

    def __init__(self, prepare: Callable[[int, FakeProducer], None] = lambda _n, _p: None):
        self.made: list[FakeProducer] = []
        self._prepare = prepare

    def __call__(self, transactional_id: str) -> AIOKafkaProducer:
        assert transactional_id == TXN_ID
        producer = FakeProducer()
        self._prepare(len(self.made), producer)
        self.made.append(producer)
        return cast(AIOKafkaProducer, producer)


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start retries without waiting (the backoff itself is tested in flow/)."""
    monkeypatch.setattr(transactions, "_START_BACKOFF", Backoff(first_s=0.001, max_s=0.001))


def _partition_producer(factory: Factory) -> PartitionProducer:
    return PartitionProducer(TP, TXN_ID, factory, "group")


MESSAGES: list[Message] = [
    ("out", b"r0", b"k", []),
    ("out", b"r1", b"k", []),
    ("dlq", b"d2", b"k", []),
]


async def test_start_retries_a_broker_out_of_reach_then_succeeds() -> None:
    """Two connection failures, then a start: three producers made, the last one kept."""

    def prepare(n: int, producer: FakeProducer) -> None:
        if n < 2:
            producer.start_error = KafkaConnectionError("unreachable")

    factory = Factory(prepare)
    producer = _partition_producer(factory)
    await producer.start()
    assert producer.running
    assert [p.calls for p in factory.made] == [["start", "stop"], ["start", "stop"], ["start"]]


async def test_start_gives_up_after_five_tries() -> None:
    """A broker out of reach five times: ProducerStartFailed naming the partition."""
    factory = Factory(lambda _n, p: setattr(p, "start_error", KafkaConnectionError("down")))
    producer = _partition_producer(factory)
    with pytest.raises(ProducerStartFailed, match=r"did not start after 5 tries"):
        await producer.start()
    assert len(factory.made) == 5
    assert not producer.running


async def test_start_refused_transactional_id_fails_at_once() -> None:
    """TransactionalIdAuthorizationFailed: no retry, the error names the transactional id."""
    factory = Factory(lambda _n, p: setattr(p, "start_error", TransactionalIdAuthorizationFailed()))
    producer = _partition_producer(factory)
    with pytest.raises(ProducerStartFailed, match=f"refuses transactional id '{TXN_ID}'"):
        await producer.start()
    assert len(factory.made) == 1


async def test_transaction_commits_messages_and_offset() -> None:
    """Every message, then the next offset, then the commit."""
    factory = Factory()
    producer = _partition_producer(factory)
    await producer.start()
    outcome = await producer.run_transaction(MESSAGES, 12)
    assert outcome == transactions.TransactionOutcome(committed=True)
    made = factory.made[0]
    assert made.sent == MESSAGES
    assert made.offsets == [{TP: OffsetAndMetadata(12, "")}]
    assert made.calls == ["start", "begin", "commit"]


async def test_fenced_producer_is_dropped_and_never_recreated_by_itself() -> None:
    """ProducerFenced: outcome fenced, the producer closed; nothing starts another one."""
    factory = Factory(lambda _n, p: setattr(p, "commit_error", ProducerFenced()))
    producer = _partition_producer(factory)
    await producer.start()
    outcome = await producer.run_transaction(MESSAGES, 12)
    assert outcome.fenced and not outcome.committed
    assert not producer.running
    assert factory.made[0].calls[-1] == "stop"
    again = await producer.run_transaction(MESSAGES, 12)
    assert not again.committed
    assert len(factory.made) == 1


async def test_state_machine_assertion_replaces_the_producer_on_the_next_replace() -> None:
    """An AssertionError from aiokafka's state machine: stopped; replace() starts a new one."""
    factory = Factory(
        lambda n, p: setattr(p, "commit_error", AssertionError("state") if n == 0 else None)
    )
    producer = _partition_producer(factory)
    await producer.start()
    outcome = await producer.run_transaction(MESSAGES, 12)
    assert not outcome.committed and not outcome.fenced
    assert not producer.running
    assert factory.made[0].calls[-1] == "stop"
    await producer.replace()
    assert producer.running and len(factory.made) == 2
    assert (await producer.run_transaction(MESSAGES, 12)).committed


async def test_message_refused_for_size_is_named_and_the_transaction_aborted() -> None:
    """One message too large: too_large names it, the transaction is aborted, and the
    producer replaced (aiokafka keeps the refused batch's sequence numbers)."""
    factory = Factory(lambda n, p: setattr(p, "refuse", {1} if n == 0 else set()))
    producer = _partition_producer(factory)
    await producer.start()
    outcome = await producer.run_transaction(MESSAGES, 12)
    assert outcome == transactions.TransactionOutcome(committed=False, too_large=(1,))
    first = factory.made[0]
    assert first.calls == ["start", "begin", "abort", "stop"]
    assert first.offsets == []  # the offset never went into the aborted transaction
    assert not producer.running
    await producer.replace()
    assert (await producer.run_transaction([MESSAGES[0], MESSAGES[2]], 12)).committed
