"""One partition's transactional producer: start retries, fencing, a broken state machine,
a refusal for size.

The producer is an in-memory fake at the factory seam: a broker out of reach
during one assignment, an AssertionError from aiokafka's transaction state machine
and a refusal for size of one message inside a transaction cannot be produced on
demand by a real broker.
"""

from __future__ import annotations

import pytest
from aiokafka.errors import (
    KafkaConnectionError,
    ProducerFenced,
    TransactionalIdAuthorizationFailed,
)
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from tests.unit.kafka.aiokafka.fakes import Factory, FakeProducer
from worker.flow.retry import Backoff
from worker.kafka.aiokafka import transactions
from worker.kafka.aiokafka.transactions import PartitionProducer
from worker.kafka.transactions import Message, ProducerStartFailed, TransactionOutcome

pytestmark = pytest.mark.timeout(10)

TP = TopicPartition("in", 3)
TXN_ID = "prefix-group-in-3"


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start retries without waiting (the backoff itself is tested in flow/)."""
    monkeypatch.setattr(transactions, "START_BACKOFF", Backoff(first_s=0.001, max_s=0.001))


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

    factory = Factory(TXN_ID, prepare)
    producer = _partition_producer(factory)
    await producer.start()
    assert producer.running
    assert [p.calls for p in factory.made] == [["start", "stop"], ["start", "stop"], ["start"]]


async def test_start_gives_up_after_twenty_tries() -> None:
    """A broker out of reach 20 times (about a minute with the backoff: longer than a broker
    restart, which five tries did not outlast): ProducerStartFailed naming the partition."""
    factory = Factory(TXN_ID, lambda _n, p: setattr(p, "start_error", KafkaConnectionError("down")))
    producer = _partition_producer(factory)
    with pytest.raises(ProducerStartFailed, match=r"did not start after 20 tries"):
        await producer.start()
    assert len(factory.made) == 20
    assert not producer.running


async def test_start_refused_transactional_id_fails_at_once() -> None:
    """TransactionalIdAuthorizationFailed: no retry, the error names the transactional id."""
    refused = TransactionalIdAuthorizationFailed()
    factory = Factory(TXN_ID, lambda _n, p: setattr(p, "start_error", refused))
    producer = _partition_producer(factory)
    with pytest.raises(ProducerStartFailed, match=f"refuses transactional id '{TXN_ID}'"):
        await producer.start()
    assert len(factory.made) == 1


async def test_transaction_commits_messages_and_offset() -> None:
    """Every message, then the next offset, then the commit."""
    factory = Factory(TXN_ID)
    producer = _partition_producer(factory)
    await producer.start()
    outcome = await producer.run_transaction(MESSAGES, 12)
    assert outcome == TransactionOutcome(committed=True)
    made = factory.made[0]
    assert made.sent == MESSAGES
    assert made.offsets == [{TP: OffsetAndMetadata(12, "")}]
    assert made.calls == ["start", "begin", "commit"]


async def test_fenced_producer_is_dropped_and_never_recreated_by_itself() -> None:
    """ProducerFenced: outcome fenced, the producer closed; nothing starts another one."""
    factory = Factory(TXN_ID, lambda _n, p: setattr(p, "commit_error", ProducerFenced()))
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
        TXN_ID, lambda n, p: setattr(p, "commit_error", AssertionError("state") if n == 0 else None)
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
    factory = Factory(TXN_ID, lambda n, p: setattr(p, "refuse", {1} if n == 0 else set()))
    producer = _partition_producer(factory)
    await producer.start()
    outcome = await producer.run_transaction(MESSAGES, 12)
    assert outcome == TransactionOutcome(committed=False, too_large=(1,))
    first = factory.made[0]
    assert first.calls == ["start", "begin", "abort", "stop"]
    assert first.offsets == []  # the offset never went into the aborted transaction
    assert not producer.running
    await producer.replace()
    assert (await producer.run_transaction([MESSAGES[0], MESSAGES[2]], 12)).committed
