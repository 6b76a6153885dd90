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
from worker.kafka.transactions import Message, ProducerStartFailed, TransactionFailed

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


async def _transaction(producer: PartitionProducer, messages: list[Message], point: int) -> None:
    """begin, send, send the offset, commit: what exactly_once does, in order."""
    await producer.begin()
    assert await producer.send(messages, one_by_one=False) == ()
    await producer.send_offsets({TP: point})
    await producer.commit()


async def test_transaction_commits_messages_and_offset() -> None:
    """Every message, then the next offset, then the commit."""
    factory = Factory(TXN_ID)
    producer = _partition_producer(factory)
    await producer.start()
    await _transaction(producer, MESSAGES, 12)
    made = factory.made[0]
    assert made.sent == MESSAGES
    assert made.offsets == [{TP: OffsetAndMetadata(12, "")}]
    assert made.calls == ["start", "begin", "commit"]


async def test_fenced_producer_is_named_fenced_and_closed_by_the_abandon() -> None:
    """ProducerFenced: TransactionFailed says fenced; the abandon closes the producer."""
    factory = Factory(TXN_ID, lambda _n, p: setattr(p, "commit_error", ProducerFenced()))
    producer = _partition_producer(factory)
    await producer.start()
    with pytest.raises(TransactionFailed) as failed:
        await _transaction(producer, MESSAGES, 12)
    assert failed.value.fenced
    await producer.abandon(str(failed.value))
    assert not producer.running
    assert factory.made[0].calls[-2:] == ["abort", "stop"]
    with pytest.raises(TransactionFailed, match="closed"):
        await producer.begin()
    assert len(factory.made) == 1


async def test_state_machine_assertion_fails_the_transaction_not_fenced() -> None:
    """An AssertionError from aiokafka's state machine: a failure, not a fencing; after the
    abandon, start() makes a new producer that commits."""
    factory = Factory(
        TXN_ID, lambda n, p: setattr(p, "commit_error", AssertionError("state") if n == 0 else None)
    )
    producer = _partition_producer(factory)
    await producer.start()
    with pytest.raises(TransactionFailed) as failed:
        await _transaction(producer, MESSAGES, 12)
    assert not failed.value.fenced
    await producer.abandon(str(failed.value))
    assert not producer.running and factory.made[0].calls[-1] == "stop"
    assert await producer.start()
    await _transaction(producer, MESSAGES, 12)
    assert factory.made[1].committed == MESSAGES


async def test_message_refused_for_size_is_named_with_its_batch() -> None:
    """One message refused by the broker for its size: send names every message of its
    batch (one per topic and partition here), not the others (the transaction is then
    abandoned: aborted, and the producer replaced, as aiokafka keeps the refused batch's
    sequence numbers)."""
    factory = Factory(TXN_ID, lambda n, p: setattr(p, "refuse", {1} if n == 0 else set()))
    producer = _partition_producer(factory)
    await producer.start()
    await producer.begin()
    assert await producer.send(MESSAGES, one_by_one=False) == (0, 1)
    assert factory.made[0].batches == [[0, 1], [2]]  # "out", then "dlq"
    await producer.abandon("refused for size")
    first = factory.made[0]
    assert first.calls == ["start", "begin", "abort", "stop"]
    assert first.offsets == []  # the offset never went into the aborted transaction
    assert await producer.start()
    await _transaction(producer, [MESSAGES[0], MESSAGES[2]], 12)


async def test_message_over_the_producers_own_limit_is_named_like_a_broker_refusal() -> None:
    """aiokafka's send() raises MessageSizeTooLargeError itself (its own size check) before
    anything is queued: the message is named refused, as one the broker refused, and the
    others are still sent and acknowledged (before, the error failed the transaction as a
    generic KafkaError, the refused dead letter was never replaced, and its partition's
    transaction was tried again with a fresh producer every interval, for ever)."""
    factory = Factory(TXN_ID, lambda _n, p: setattr(p, "refuse_at_send", {0}))
    producer = _partition_producer(factory)
    await producer.start()
    await producer.begin()
    assert await producer.send(MESSAGES, one_by_one=False) == (0,)
    assert factory.made[0].sent == MESSAGES[1:]


async def test_a_start_stops_trying_once_the_partition_is_no_longer_ours() -> None:
    """A broker out of reach, and the partition moves before the second try: start returns
    False without initialising the id again (that would fence the new owner)."""
    ours = iter([True, False])
    factory = Factory(TXN_ID, lambda _n, p: setattr(p, "start_error", KafkaConnectionError("down")))
    producer = _partition_producer(factory)
    assert not await producer.start(lambda: next(ours))
    assert len(factory.made) == 1 and not producer.running


async def test_one_by_one_sends_each_after_the_previous_ack_and_stops_at_a_refusal() -> None:
    """A refused batch names every message in it (aiokafka's batches hold several small
    ones): one_by_one sends each alone, once the one before is acknowledged, and stops at
    the first refusal, which is then exact."""
    factory = Factory(TXN_ID, lambda _n, p: setattr(p, "refuse", {1}))
    producer = _partition_producer(factory)
    assert not producer.exact_refusals
    await producer.start()
    await producer.begin()
    assert await producer.send(MESSAGES, one_by_one=True) == (1,)
    assert factory.made[0].sent == MESSAGES[:2]  # nothing after the refused one
