"""exactly_once on aiokafka: records that finish while a failed transaction's producer is down.

The partition's producer is an in-memory fake at the factory seam (see ``fakes``),
and the consumer an in-memory CommitEdge: offsets refused inside a transaction
(``REBALANCE_IN_PROGRESS``) or a commit that fails cannot be produced on demand by a
real broker. The failures a real broker does produce (a result over the output
topic's limit, a broker restart) are in tests/fault/test_exactly_once_failures.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import pytest
from aiokafka.errors import KafkaConnectionError, RebalanceInProgressError
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from tests.unit.delivery.fakes import TP, Edge, completing, record
from tests.unit.kafka.aiokafka.fakes import Factory, FakeProducer
from worker.delivery import ExactlyOnce
from worker.delivery.offsets import OffsetTracker
from worker.observability import Metrics
from worker.settings import load_settings

pytestmark = pytest.mark.timeout(10)

SETTINGS = load_settings(
    {
        "WORKER_INPUT_TOPICS": "in",
        "WORKER_OUTPUT_TOPIC": "out",
        "WORKER_DLQ_TOPIC": "dlq",
        "WORKER_GROUP_ID": "group",
        "WORKER_DELIVERY": "exactly_once",
    }
)


async def _started(factory: Factory) -> ExactlyOnce:
    delivery = ExactlyOnce(
        SETTINGS,
        OffsetTracker(),
        Edge(transactions_only=True),
        Metrics(version="test"),
        new_producer=factory,  # a fake at the factory seam
    )
    await delivery.assigned({TP})
    return delivery


async def _complete(delivery: ExactlyOnce, offset: int) -> asyncio.Task[None]:
    """Dispatch the record and complete it with a result; returns once it is staged (the
    task ends when its transaction commits)."""
    rec = record(offset)

    async def deliver() -> None:
        await delivery.publish_result(rec, b"r%d" % offset, [])

    return await completing(delivery, rec, deliver)


def _values(producer: FakeProducer) -> list[bytes | None]:
    return [value for _, value, _, _ in producer.committed]


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param(("offsets_error", RebalanceInProgressError()), id="rebalance-in-progress"),
        pytest.param(("commit_error", KafkaConnectionError()), id="commit-failed"),
    ],
)
async def test_record_finishing_after_a_failed_transaction_is_committed_by_the_next_flush(
    failure: tuple[str, Exception],
) -> None:
    """A transaction fails and its producer closes; a record finishing then is staged, and
    the next flush commits both records on a fresh producer, each once."""
    attribute, error = failure
    factory = Factory(
        "kafka-triton-worker-group-in-0",
        lambda n, p: setattr(p, attribute, error if n == 0 else None),
    )
    delivery = await _started(factory)
    first = await _complete(delivery, 0)
    await delivery.commit()
    assert [p.calls[-1] for p in factory.made] == ["stop"]  # the failed transaction's producer
    second = await _complete(delivery, 1)
    await delivery.commit()
    await asyncio.gather(first, second)
    assert len(factory.made) == 2
    assert _values(factory.made[1]) == [b"r0", b"r1"]
    assert factory.made[1].offsets == [{TP: OffsetAndMetadata(2, "")}]
    assert _values(factory.made[0]) == []
    assert delivery.offsets.commit_point(TP) == 2
    await delivery.close()


TP1 = TopicPartition("in", 1)


class _TwoPartitions(Edge):
    """Partitions 0 and 1; the committed offsets are those the producers' transactions sent."""

    def __init__(self, producers: dict[str, FakeProducer]) -> None:
        super().__init__({TP, TP1}, transactions_only=True)
        self._producers = producers

    async def fetch_committed(
        self, partitions: Iterable[TopicPartition]
    ) -> dict[TopicPartition, OffsetAndMetadata]:
        sent = [o for p in self._producers.values() for o in p.offsets]
        return {tp: meta for offsets in sent for tp, meta in offsets.items() if tp in partitions}


async def test_no_partition_commits_before_the_offsets_of_every_assigned_one_are_read() -> None:
    """Two partitions, the second's producer slow to start: the first stays not ready until
    the offsets are read, then its record is committed once and nothing is sought (before,
    it committed meanwhile, the read took that for a previous owner's commit and sought
    back to it: its staged records came again, "staged twice")."""
    reached, gate = asyncio.Event(), asyncio.Event()
    producers: dict[str, FakeProducer] = {}

    class Slow(FakeProducer):
        async def start(self) -> None:
            reached.set()
            await gate.wait()
            await super().start()

    def factory(transactional_id: str) -> FakeProducer:
        producer = Slow() if transactional_id.endswith("-1") else FakeProducer()
        producers[transactional_id] = producer
        return producer

    delivery = ExactlyOnce(
        SETTINGS,
        OffsetTracker(),
        _TwoPartitions(producers),
        Metrics(version="test"),
        new_producer=factory,  # a fake at the factory seam
    )
    assigning = asyncio.create_task(delivery.assigned({TP, TP1}))
    await reached.wait()  # partition 0's producer has started; partition 1's has not
    assert delivery.not_ready() == [str(TP), str(TP1)]
    gate.set()
    await assigning
    assert delivery.not_ready() == []
    task = await _complete(delivery, 0)
    await delivery.commit()
    await task
    (first, _) = producers.values()
    assert _values(first) == [b"r0"]
    assert first.offsets == [{TP: OffsetAndMetadata(1, "")}]
    await delivery.close()


async def test_exactly_once_completes_one_record_at_a_time() -> None:
    """No batches: each outcome is staged in its partition's transaction, in offset order."""
    delivery = await _started(Factory("kafka-triton-worker-group-in-0"))
    assert not delivery.takes_batches
    with pytest.raises(NotImplementedError, match="one record at a time"):
        await delivery.complete_many([(record(0), b"r0", [])], [delivery.track(record(0))])
    await delivery.close()
