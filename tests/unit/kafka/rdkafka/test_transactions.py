"""exactly_once on librdkafka: every failed transaction ends in an abort or a fresh producer,
its records redone at once by the same member, and a commit never sent twice.

librdkafka's producer is an in-memory fake at the ``confluent_kafka.Producer`` seam
(``rdkafka_fakes``): a record refused before it is queued (``_STATE``, ``_FATAL``,
``_UNKNOWN_TOPIC``), offsets refused with ``REBALANCE_IN_PROGRESS`` or not answered
past their timeout, a commit that times out after the coordinator accepted it and
records held in flight after a refused one cannot be produced on demand by a real
broker. The records refused for size by a
real broker are in tests/fault/test_exactly_once_failures.py.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord, TopicPartition

from tests.unit.delivery.fakes import Edge, completing, record
from tests.unit.kafka.rdkafka.fakes import Broker, KafkaError, rd_error
from worker.delivery import ExactlyOnce
from worker.delivery.offsets import OffsetTracker
from worker.errors import OutputTooLarge
from worker.flow.retry import Backoff
from worker.kafka.rdkafka import transactions as rdkafka_transactions
from worker.observability import Metrics
from worker.settings import load_settings

pytestmark = pytest.mark.timeout(10)

#: A failed transaction's last calls: what was queued purged, the transaction aborted, then
#: the producer destroyed (its leftovers purged, the client closed) in the background, by
#: the time the delivery closes at the latest.
_ABORTED_THEN_DESTROYED = ["purge", "abort", "purge", "close"]


def _aborted(producer: Any) -> bool:
    """The producer's transaction was aborted once what was queued had been purged (its
    destruction, in the background, may have begun since)."""
    calls = producer.calls
    return "abort" in calls and calls[calls.index("abort") - 1] == "purge"


PARTITIONS = [TopicPartition("in", 0), TopicPartition("in", 1)]
SETTINGS = load_settings(
    {
        "WORKER_INPUT_TOPICS": "in",
        "WORKER_OUTPUT_TOPIC": "out",
        "WORKER_DLQ_TOPIC": "dlq",
        "WORKER_GROUP_ID": "group",
        "WORKER_CLIENT_ID": "member",
        "WORKER_DELIVERY": "exactly_once",
        "WORKER_KAFKA_CLIENT": "confluent",
    }
)
#: Bound on one commit() against the in-memory broker: far below librdkafka's timeouts
#: (a transaction waiting for reports that never come fails it).
COMMIT_BOUND_S = 2.0


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Commit retries without waiting (the backoff itself is tested in flow/), and offsets
    given up on 0.2 s after they were sent."""
    quick = Backoff(first_s=0.001, max_s=0.001)
    monkeypatch.setattr(rdkafka_transactions, "_COMMIT_RETRY_BACKOFF", quick)
    monkeypatch.setattr(rdkafka_transactions, "_OFFSETS_TIMEOUT_S", 0.1)
    monkeypatch.setattr(rdkafka_transactions, "_OFFSETS_GRACE_S", 0.1)


async def _started() -> ExactlyOnce:
    edge = Edge(PARTITIONS, transactions_only=True)
    config = rdkafka_transactions.transactional_config(
        {"bootstrap.servers": "127.0.0.1:9", "batch.size": 512 * 1024},
        prefix="kafka-triton-worker",
        group_id="group",
        client_id="member",
    )
    delivery = ExactlyOnce(
        SETTINGS,
        OffsetTracker(),
        edge,
        Metrics(version="test"),
        transactions=rdkafka_transactions.GroupFencedTransactions(config, edge.group_metadata),
    )
    await delivery.assigned(set(PARTITIONS))
    return delivery


async def _complete(
    delivery: ExactlyOnce,
    rec: ConsumerRecord[bytes, bytes],
    dead_lettered: asyncio.Event | None = None,
) -> Any:
    """Dispatch the record and complete it with its result (value ``P:O``), or its dead
    letter; returns once it is staged (the task ends when its transaction commits).
    ``dead_lettered`` is set once a result refused for size has its dead letter staged."""

    async def deliver() -> None:
        # As the record's own path does: a result refused for size becomes a dead letter.
        try:
            await delivery.publish_result(rec, f"{rec.partition}:{rec.offset}".encode(), [])
        except OutputTooLarge:
            if dead_lettered is not None:
                # Set before the call, seen after it: the dead letter is staged before this
                # task first pauses (publish_dead_letter then waits for its commit).
                dead_lettered.set()
            await delivery.publish_dead_letter(rec, [("x-error-code", b"OUTPUT_TOO_LARGE")])

    return await completing(delivery, rec, deliver)


async def _commit(delivery: ExactlyOnce) -> None:
    await asyncio.wait_for(delivery.commit(), COMMIT_BOUND_S)


async def _complete_all(
    delivery: ExactlyOnce, offsets: range, dead_lettered: asyncio.Event | None = None
) -> dict[tuple[int, int], Any]:
    """Records at ``offsets`` of each partition completed, in turn; their tasks by
    (partition, offset)."""
    return {
        (tp.partition, o): await _complete(delivery, record(o, tp), dead_lettered)
        for o in offsets
        for tp in PARTITIONS
    }


def _answers(offsets: range) -> list[tuple[str, bytes | None]]:
    return sorted(("out", f"{tp.partition}:{o}".encode()) for o in offsets for tp in PARTITIONS)


def _visible(broker: Broker) -> list[tuple[str, bytes | None]]:
    return sorted(broker.visible, key=lambda m: (m[0], m[1] or b""))


@pytest.mark.parametrize(
    "code",
    [KafkaError._STATE, KafkaError._FATAL, KafkaError._UNKNOWN_TOPIC],
    ids=["_STATE", "_FATAL", "_UNKNOWN_TOPIC"],
)
async def test_record_refused_before_it_is_queued_fails_the_transaction_not_the_worker(
    broker: Broker, code: int
) -> None:
    """produce() raises midway: the transaction is aborted, the producer closed, and the next
    commit sends every record again on a fresh producer; each visible once."""
    delivery = await _started()
    tasks = await _complete_all(delivery, range(2))
    broker.produce_errors[2] = rd_error(code, fatal=code == KafkaError._FATAL)
    await _commit(delivery)
    first = broker.producers[0]
    assert _aborted(first)
    assert broker.visible == []
    await _commit(delivery)
    await asyncio.gather(*tasks.values())
    assert len(broker.producers) == 2
    assert _visible(broker) == _answers(range(2))
    assert broker.offsets == [{("in", 0): 2, ("in", 1): 2}]
    await delivery.close()
    assert first.calls[-4:] == _ABORTED_THEN_DESTROYED


async def test_records_finishing_after_offsets_refused_are_committed_by_the_next_flush(
    broker: Broker,
) -> None:
    """REBALANCE_IN_PROGRESS from send_offsets_to_transaction: the producer is closed; records
    finishing then are staged, and the next commit carries them all, on every partition."""
    delivery = await _started()
    before = await _complete_all(delivery, range(2))
    broker.offsets_errors.append(rd_error(KafkaError.REBALANCE_IN_PROGRESS))
    await _commit(delivery)
    assert "abort" in broker.producers[0].calls
    after = await _complete_all(delivery, range(2, 4))
    await _commit(delivery)
    await asyncio.gather(*before.values(), *after.values())
    assert _visible(broker) == _answers(range(4))
    assert broker.offsets == [{("in", 0): 4, ("in", 1): 4}]
    await delivery.close()
    assert broker.producers[0].calls[-3:] == _ABORTED_THEN_DESTROYED[1:]


async def test_offsets_call_blocked_past_its_timeout_is_given_up_and_redone(
    broker: Broker,
) -> None:
    """send_offsets_to_transaction blocks past its timeout (librdkafka does not always honour
    it): the transaction is aborted, the producer replaced, and the next commit carries all."""
    delivery = await _started()
    tasks = await _complete_all(delivery, range(2))
    release = threading.Event()
    broker.offsets_stuck = release
    try:
        await _commit(delivery)
        assert _aborted(broker.producers[0])
        assert broker.visible == []
        await _commit(delivery)
        await asyncio.gather(*tasks.values())
    finally:
        release.set()  # the thread left to librdkafka returns at last
    assert len(broker.producers) == 2
    assert _visible(broker) == _answers(range(2))
    assert broker.offsets == [{("in", 0): 2, ("in", 1): 2}]
    await delivery.close()
    assert broker.producers[0].calls[-4:] == _ABORTED_THEN_DESTROYED


async def test_the_next_transaction_does_not_wait_for_the_failed_producers_destruction(
    broker: Broker,
) -> None:
    """librdkafka can take seconds to destroy a producer whose transaction failed (5 s and
    more with the coordinator out of reach after a broker restart, which stalled every
    partition as long): the next commit goes on a fresh producer meanwhile, and closing the
    delivery waits for the destruction."""
    delivery = await _started()
    tasks = await _complete_all(delivery, range(2))
    release = threading.Event()
    broker.close_stuck = release
    broker.offsets_errors.append(rd_error(KafkaError.REBALANCE_IN_PROGRESS))
    try:
        await _commit(delivery)
        await _commit(delivery)  # within COMMIT_BOUND_S, the first producer's close stuck
        await asyncio.gather(*tasks.values())
        assert "close" not in broker.producers[0].calls
    finally:
        release.set()
    assert _visible(broker) == _answers(range(2))
    await delivery.close()
    assert broker.producers[0].calls[-1] == "close"


async def test_commit_timing_out_after_the_coordinator_accepted_it_is_not_sent_twice(
    broker: Broker,
) -> None:
    """commit_transaction raises the retriable _TIMED_OUT though the commit went through:
    it is made again, not aborted, and no outcome becomes visible twice."""
    delivery = await _started()
    tasks = await _complete_all(delivery, range(3))
    broker.commit_errors.append((rd_error(KafkaError._TIMED_OUT, retriable=True), True))
    await _commit(delivery)
    await _commit(delivery)  # nothing left to send: it went into the first transaction
    await asyncio.gather(*tasks.values())
    assert _visible(broker) == _answers(range(3))
    assert broker.offsets == [{("in", 0): 3, ("in", 1): 3}]
    assert broker.producers[0].calls[-2:] == ["commit", "commit"]
    assert "abort" not in broker.producers[0].calls
    await delivery.close()


async def test_transaction_fails_at_its_first_refused_record_not_after_the_others(
    broker: Broker,
) -> None:
    """A record refused for size, the records queued after it held in flight: the failure is
    seen at once, the rest purged and aborted; the next commit has the refused one's dead
    letter (OUTPUT_TOO_LARGE) and every other result."""
    delivery = await _started()
    dead_lettered = asyncio.Event()
    tasks = await _complete_all(delivery, range(3), dead_lettered)
    broker.refuse.add(1)  # the transaction's second record: partition 0's at offset 1
    broker.hold_after_refusal = True
    await _commit(delivery)
    assert _aborted(broker.producers[0])
    assert broker.visible == []
    # The refused record's path stages its dead letter when it next runs; until then its
    # partition commits only what comes before it (which Python's wait_for may or may not
    # leave time for: 3.11 runs the commit in a task of its own, 3.12 and later do not).
    await dead_lettered.wait()
    await _commit(delivery)
    await asyncio.gather(*tasks.values())
    answers = [m for m in _answers(range(3)) if m != ("out", b"0:1")]
    assert _visible(broker) == [("dlq", b"v"), *answers]
    await delivery.close()
    assert broker.producers[0].calls[-4:] == _ABORTED_THEN_DESTROYED
