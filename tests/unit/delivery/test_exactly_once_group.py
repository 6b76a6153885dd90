"""exactly_once on librdkafka: one transaction for every partition, fenced by the group.

The transactional producer is an in-memory fake in place of ``GroupTransactions`` (what
the delivery mode asks of it: start, one transaction at a time, stop), and the consumer
an in-memory edge with group metadata: a real broker cannot be made to fence a member,
refuse a batch for its size, or start a rebalance at a chosen moment. The transactions
against a real broker are in tests/fault/test_exactly_once_group.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from aiokafka.structs import TopicPartition

from tests.unit.delivery.fakes import Edge, completing, record
from worker import errors
from worker.delivery.exactly_once_group import GroupFencedExactlyOnce
from worker.delivery.offsets import OffsetTracker
from worker.kafka.edge import GroupFenced
from worker.kafka.transactions import Message, TransactionOutcome
from worker.observability import Metrics
from worker.settings import load_settings

pytestmark = pytest.mark.timeout(10)

TP0, TP1 = TopicPartition("in", 0), TopicPartition("in", 1)
SETTINGS = load_settings(
    {
        "WORKER_INPUT_TOPICS": "in",
        "WORKER_OUTPUT_TOPIC": "out",
        "WORKER_DLQ_TOPIC": "dlq",
        "WORKER_GROUP_ID": "group",
        "WORKER_DELIVERY": "exactly_once",
        "WORKER_KAFKA_CLIENT": "confluent",
    }
)


class Transactions:
    """What the delivery mode uses of GroupTransactions; each transaction's outcome is the
    next of ``outcomes`` (committed once they run out)."""

    transactional_id = "kafka-triton-worker-group-worker"

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.running = False
        self.starts = 0
        self.outcomes: list[TransactionOutcome] = []
        self.sent: list[tuple[list[Message], dict[TopicPartition, int], Any, bool]] = []

    async def start(self) -> None:
        self.starts += 1
        self.running = True

    async def replace(self) -> None:
        await self.start()

    async def stop(self) -> None:
        self.running = False

    async def run_transaction(
        self,
        messages: Sequence[Message],
        offsets: Mapping[TopicPartition, int],
        group: Any,
        *,
        one_by_one: bool = False,
    ) -> TransactionOutcome:
        self.sent.append((list(messages), dict(offsets), group, one_by_one))
        return self.outcomes.pop(0) if self.outcomes else TransactionOutcome(committed=True)


async def started(edge: Edge | None = None) -> tuple[GroupFencedExactlyOnce, Transactions]:
    txn = Transactions()
    delivery = GroupFencedExactlyOnce(
        SETTINGS,
        OffsetTracker(),
        edge or Edge({TP0, TP1}, transactions_only=True, fetches=False),
        Metrics(version="test"),
        # The producer seam: the fake in place of GroupTransactions.
        transactions=GroupFenced({"bootstrap.servers": "unused:9092"}, lambda _config: txn),  # type: ignore[arg-type,return-value]
    )
    await delivery.assigned({TP0, TP1})
    return delivery, txn


async def staged(delivery: GroupFencedExactlyOnce, tp: TopicPartition, offset: int) -> Any:
    """Complete the record with a result; returns its task once the result is staged (the
    task ends when the transaction carrying it commits)."""
    rec = record(offset, tp)

    async def deliver() -> None:
        await delivery.publish_result(rec, b"%s-%d" % (tp.topic.encode(), offset), [])

    return await completing(delivery, rec, deliver)


def values(messages: list[Message]) -> list[bytes | None]:
    return [value for _, value, _, _ in messages]


async def test_one_transaction_carries_every_partition_with_the_group_metadata() -> None:
    """Records of two partitions: one transaction, both results, both next offsets, sent
    with the consumer's group metadata; each record's completion returns once it commits."""
    delivery, txn = await started()
    assert txn.starts == 1 and not delivery.takes_batches
    tasks = [await staged(delivery, TP0, 0), await staged(delivery, TP1, 5)]
    assert not any(task.done() for task in tasks)
    await delivery.commit()
    await asyncio.gather(*tasks)
    [(messages, offsets, group, one_by_one)] = txn.sent
    assert sorted(values(messages), key=lambda value: value or b"") == [b"in-0", b"in-5"]
    assert offsets == {TP0: 1, TP1: 6} and group == "generation-7" and not one_by_one
    assert delivery.offsets.commit_point(TP0) == 1
    await delivery.close()


async def test_a_fenced_member_drops_its_partitions_and_their_records() -> None:
    """The group moved on: the transaction is fenced; the partitions it carried are dropped
    and their staged records end revoked (their next owner redoes them)."""
    delivery, txn = await started()
    txn.outcomes = [TransactionOutcome(committed=False, fenced=True)]
    task = await staged(delivery, TP0, 0)
    await delivery.commit()
    with pytest.raises(errors.PartitionRevoked, match="fenced"):
        await task
    assert set(delivery._partitions) == {TP1}
    await delivery.close()


async def test_records_finishing_after_the_fencing_end_at_once() -> None:
    """A record of a fenced partition that finishes after the fencing (its inference was
    still running) ends revoked at once: it must not wait for the partition's revocation,
    which itself waits for the partition's records (each waited out the other's bound,
    and a stop meanwhile abandoned the record, exit 1)."""
    delivery, txn = await started()
    txn.outcomes = [TransactionOutcome(committed=False, fenced=True)]
    task = await staged(delivery, TP0, 0)
    late = record(1, TP0)
    ticket = delivery.track(late)  # dispatched before the fencing, still at Triton
    await delivery.commit()
    with pytest.raises(errors.PartitionRevoked, match="fenced"):
        await task

    async def deliver() -> None:
        await delivery.publish_result(late, b"late", [])

    completion = delivery.complete(late, ticket, deliver, lambda: None)
    with pytest.raises(errors.PartitionRevoked, match="fenced"):
        await asyncio.wait_for(completion, 1)
    # A later assignment of the partition takes records again.
    delivery.forget({TP0})
    await delivery.assigned({TP0})
    task = await staged(delivery, TP0, 2)
    await delivery.commit()
    await task
    await delivery.close()


async def test_a_rebalance_beginning_defers_the_transaction() -> None:
    """No group metadata (a rebalance began): nothing sent; the next commit carries it."""
    edge = Edge({TP0, TP1}, transactions_only=True, fetches=False)
    delivery, txn = await started(edge)
    task = await staged(delivery, TP0, 0)
    edge.metadata_error = RuntimeError("rebalance in progress")
    await delivery.commit()
    assert txn.sent == [] and not task.done()
    edge.metadata_error = None
    await delivery.commit()
    await task
    assert len(txn.sent) == 1
    await delivery.close()


async def test_a_batch_refused_for_size_is_sent_one_by_one_to_find_the_culprit() -> None:
    """Both results refused (one batch): the next transaction goes one by one; the one
    refused alone becomes OUTPUT_TOO_LARGE for its record, the other commits."""
    delivery, txn = await started()
    txn.outcomes = [
        TransactionOutcome(committed=False, too_large=(0, 1)),
        TransactionOutcome(committed=False, too_large=(1,)),
    ]
    innocent, culprit = await staged(delivery, TP0, 0), await staged(delivery, TP0, 1)
    await delivery.commit()
    await delivery.commit()
    with pytest.raises(errors.OutputTooLarge):
        await culprit
    assert [sent[3] for sent in txn.sent] == [False, True]
    assert not innocent.done()  # held until the culprit's dead letter is staged
    await delivery.close()
    with pytest.raises(errors.PartitionRevoked, match="closing"):
        await innocent  # ended by the close (a task left unawaited is logged when collected)


async def test_a_revocation_commits_what_is_done_and_keeps_the_producer() -> None:
    """Partition 1 revoked: its done records commit first; the producer stays for 0."""
    delivery, txn = await started()
    task = await staged(delivery, TP1, 3)
    await delivery.revoked({TP1})
    await task
    assert [offsets for _, offsets, _, _ in txn.sent] == [{TP1: 4}]
    assert txn.running and set(delivery._partitions) == {TP0}
    await delivery.close()
    assert not txn.running
