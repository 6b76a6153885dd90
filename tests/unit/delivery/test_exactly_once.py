"""exactly_once over either client's transactions: staging, fencing, refusals, ownership.

The transactional producers are in-memory fakes: aiokafka's at the factory seam of
``PerPartitionTransactions`` (``tests.unit.kafka.aiokafka.fakes``), and a producer shared
by every partition as librdkafka's is (``fakes.Transactional``); the consumer is an
in-memory CommitEdge. A real broker cannot be made to fence a member, refuse offsets
with REBALANCE_IN_PROGRESS, refuse a batch for its size or move a partition at a chosen
moment. The failures a real broker does produce (a result over the output topic's limit,
a broker restart) are in tests/fault/test_exactly_once_failures.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, RebalanceInProgressError
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from tests.unit.delivery.fakes import TP, Edge, Shared, Transactional, completing, record
from tests.unit.kafka.aiokafka.fakes import Factory, FakeProducer
from worker import errors
from worker.delivery import ExactlyOnce
from worker.delivery.offsets import OffsetTracker
from worker.flow.retry import Backoff
from worker.kafka.aiokafka import transactions as aio_transactions
from worker.kafka.aiokafka.transactions import PerPartitionTransactions, ProducerFactory
from worker.kafka.transactions import Message
from worker.observability import Metrics
from worker.settings import Settings, load_settings
from worker.wire.headers import X_ORIGINAL_VALUE_BYTES, X_ORIGINAL_VALUE_SHA256

pytestmark = pytest.mark.timeout(10)


def _settings(**extra: str) -> Settings:
    """exactly_once over topics in, out and dlq, for group ``group``; ``extra``: more
    settings, named without their WORKER_ prefix."""
    return load_settings(
        {
            "WORKER_INPUT_TOPICS": "in",
            "WORKER_OUTPUT_TOPIC": "out",
            "WORKER_DLQ_TOPIC": "dlq",
            "WORKER_GROUP_ID": "group",
            "WORKER_DELIVERY": "exactly_once",
            **{f"WORKER_{name}": value for name, value in extra.items()},
        }
    )


SETTINGS = _settings()
TP0, TP1 = TP, TopicPartition("in", 1)


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start retries without waiting (the backoff itself is tested in flow/)."""
    monkeypatch.setattr(aio_transactions, "START_BACKOFF", Backoff(first_s=0.001, max_s=0.001))


def per_partition(factory: ProducerFactory) -> PerPartitionTransactions:
    """aiokafka's transactions, their producers made by ``factory`` (a fake at the seam)."""
    return PerPartitionTransactions("group", "kafka-triton-worker", factory)


async def _started(factory: Factory, edge: Edge | None = None) -> ExactlyOnce:
    delivery = ExactlyOnce(
        SETTINGS,
        OffsetTracker(),
        edge or Edge(transactions_only=True),
        Metrics(version="test"),
        transactions=per_partition(factory),
    )
    await delivery.assigned({TP})
    return delivery


async def _shared(edge: Edge | None = None) -> tuple[ExactlyOnce, Shared]:
    return await _shared_with(None, edge)


async def _shared_with(
    producer: Transactional | None, edge: Edge | None = None
) -> tuple[ExactlyOnce, Shared]:
    transactions = Shared(producer)
    delivery = ExactlyOnce(
        SETTINGS,
        OffsetTracker(),
        edge or Edge({TP0, TP1}, transactions_only=True, fetches=False),
        Metrics(version="test"),
        transactions=transactions,
    )
    await delivery.assigned({TP0, TP1})
    return delivery, transactions


async def _complete(
    delivery: ExactlyOnce, offset: int, tp: TopicPartition = TP
) -> asyncio.Task[None]:
    """Dispatch the record and complete it with a result; returns once it is staged (the
    task ends when its transaction commits)."""
    rec = record(offset, tp)

    async def deliver() -> None:
        await delivery.publish_result(rec, b"%s-%d" % (tp.topic.encode(), offset), [])

    return await completing(delivery, rec, deliver)


def _values(messages: list[Message]) -> list[bytes | None]:
    return [value for _, value, _, _ in messages]


# -- a producer per partition (aiokafka) ----------------------------------------------


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
    assert _values(factory.made[1].committed) == [b"in-0", b"in-1"]
    assert factory.made[1].offsets == [{TP: OffsetAndMetadata(2, "")}]
    assert _values(factory.made[0].committed) == []
    assert delivery.offsets.commit_point(TP) == 2
    await delivery.close()


class _TwoPartitions(Edge):
    """Partitions 0 and 1; the committed offsets are those the producers' transactions sent."""

    def __init__(self, producers: dict[str, FakeProducer]) -> None:
        super().__init__({TP0, TP1}, transactions_only=True)
        self._producers = producers

    async def fetch_committed(
        self, partitions: Iterable[TopicPartition]
    ) -> dict[TopicPartition, OffsetAndMetadata]:
        sent = [o for p in self._producers.values() for o in p.offsets]
        return {tp: meta for offsets in sent for tp, meta in offsets.items() if tp in partitions}


def _on_two_partitions(
    make: Callable[[str], FakeProducer],
) -> tuple[ExactlyOnce, dict[str, FakeProducer]]:
    """exactly_once over partitions 0 and 1 (not assigned yet), a producer per partition
    made by ``make`` from its transactional id; the producers by id, as they are made."""
    producers: dict[str, FakeProducer] = {}

    def factory(transactional_id: str) -> Any:
        producers[transactional_id] = producer = make(transactional_id)
        return producer

    delivery = ExactlyOnce(
        SETTINGS,
        OffsetTracker(),
        _TwoPartitions(producers),
        Metrics(version="test"),
        transactions=per_partition(factory),
    )
    return delivery, producers


async def test_no_partition_commits_before_the_offsets_of_every_assigned_one_are_read() -> None:
    """Two partitions, the second's producer slow to start: the first stays not ready until
    the offsets are read, then its record is committed once and nothing is sought (before,
    it committed meanwhile, the read took that for a previous owner's commit and sought
    back to it: its staged records came again, "staged twice")."""
    reached, gate = asyncio.Event(), asyncio.Event()

    class Slow(FakeProducer):
        async def start(self) -> None:
            reached.set()
            await gate.wait()
            await super().start()

    delivery, producers = _on_two_partitions(
        lambda transactional_id: Slow() if transactional_id.endswith("-1") else FakeProducer()
    )
    assigning = asyncio.create_task(delivery.assigned({TP0, TP1}))
    await reached.wait()  # partition 0's producer has started; partition 1's has not
    assert delivery.not_ready() == [str(TP0), str(TP1)]
    gate.set()
    await assigning
    assert delivery.not_ready() == []
    task = await _complete(delivery, 0)
    await delivery.commit()
    await task
    (first, _) = producers.values()
    assert _values(first.committed) == [b"in-0"]
    assert first.offsets == [{TP: OffsetAndMetadata(1, "")}]
    await delivery.close()


async def test_the_partitions_transactions_run_side_by_side() -> None:
    """A producer per partition: both transactions are under way before either commits
    (one round trip of the slowest per commit, not the sum), and each commits its own."""
    gate, both = asyncio.Event(), asyncio.Event()
    committing_now = 0

    class Gated(FakeProducer):
        async def commit_transaction(self) -> None:
            nonlocal committing_now
            committing_now += 1
            if committing_now == 2:
                both.set()
            await gate.wait()
            await super().commit_transaction()

    delivery, producers = _on_two_partitions(lambda _id: Gated())
    await delivery.assigned({TP0, TP1})
    tasks = [await _complete(delivery, 0, TP0), await _complete(delivery, 0, TP1)]
    committing = asyncio.create_task(delivery.commit())
    await asyncio.wait_for(both.wait(), 5)  # one after the other, the second never begins
    gate.set()
    await committing
    await asyncio.gather(*tasks)
    assert [_values(p.committed) for p in producers.values()] == [[b"in-0"], [b"in-0"]]
    assert delivery.offsets.commit_point(TP0) == delivery.offsets.commit_point(TP1) == 1
    await delivery.close()


async def test_a_group_of_results_is_staged_at_once_and_returns_once_committed() -> None:
    """complete_many: three results staged together (on_safe once they are), one
    transaction carries them and the next offset; each result's outcome is None, and
    ``then`` is awaited with every index after the commit."""
    factory = Factory("kafka-triton-worker-group-in-0")
    delivery = await _started(factory)
    records = [record(o) for o in range(3)]
    tickets = [delivery.track(r) for r in records]
    safe, audited = asyncio.Event(), []

    async def then(indexes: list[int]) -> None:
        audited.append(list(indexes))

    completing = asyncio.create_task(
        delivery.complete_many(
            [(r, b"in-%d" % r.offset, []) for r in records],
            tickets,
            on_safe=safe.set,
            then=then,
        )
    )
    await safe.wait()
    assert not completing.done()  # staged, not committed yet
    await delivery.commit()
    await completing
    assert audited == [[0, 1, 2]]
    assert _values(factory.made[0].committed) == [b"in-0", b"in-1", b"in-2"]
    assert factory.made[0].offsets == [{TP: OffsetAndMetadata(3, "")}]
    await delivery.close()


async def test_a_result_of_a_group_refused_for_size_is_returned_and_replaced_alone() -> None:
    """The group returns once staged (within the bound); the transaction then refuses its
    batch for the second result's size: the next one sends the results one by one and
    finds it; it is told as OutputTooLarge, and its partition commits below it; its record
    (done already) completes alone with its dead letter, and the next transaction carries
    all three."""
    factory = Factory(
        "kafka-triton-worker-group-in-0",
        lambda n, p: setattr(p, "refuse", {1} if n < 2 else set()),
    )
    delivery = await _started(factory)
    records = [record(o) for o in range(3)]
    tickets = [delivery.track(r) for r in records]
    refused: list[tuple[int, BaseException]] = []
    staged, told = asyncio.Event(), asyncio.Event()

    def on_refused(index: int, error: BaseException) -> None:
        refused.append((index, error))
        told.set()

    completing = asyncio.create_task(
        delivery.complete_many(
            [(r, b"in-%d" % r.offset, []) for r in records],
            tickets,
            on_safe=staged.set,
            on_refused=on_refused,
        )
    )
    await staged.wait()
    await completing  # staged within the bound: the group's slots may go
    await delivery.commit()  # the batch refused: not knowing which, the transaction ends
    assert factory.made[0].batches == [[0, 1, 2]] and not refused
    await delivery.commit()  # one by one: the second is refused
    await told.wait()
    [(index, error)] = refused
    assert index == 1 and isinstance(error, errors.OutputTooLarge)
    assert not [o for p in factory.made for o in p.offsets]  # abandoned: nothing committed

    async def deliver() -> None:
        await delivery.publish_dead_letter(records[1], [("x-error-code", b"OUTPUT_TOO_LARGE")])

    alone = asyncio.create_task(delivery.complete(records[1], tickets[1], deliver, lambda: None))
    await asyncio.sleep(0)  # the record's own path stages its dead letter
    await delivery.commit()
    await alone
    assert delivery.offsets.commit_point(TP) == 3
    committed = [m for p in factory.made for m in p.committed]
    assert sorted((t, v) for t, v, _, _ in committed) == [
        ("dlq", b"v"),
        ("out", b"in-0"),
        ("out", b"in-2"),
    ]
    assert [o for p in factory.made for o in p.offsets][-1] == {TP: OffsetAndMetadata(3, "")}
    await delivery.close()


def _small_window(n: int, shared: bool = False) -> tuple[ExactlyOnce, Factory]:
    """exactly_once with a window of ``n`` slots (so ``n`` outcomes staged at most before a
    group waits), over aiokafka's transactions (or one producer shared by every partition,
    librdkafka's); its partitions assigned by the caller."""
    settings = _settings(
        MAX_IN_FLIGHT=str(n), MAX_IN_FLIGHT_PER_PARTITION=str(n), COMMIT_INTERVAL_MS="600000"
    )
    factory = Factory("kafka-triton-worker-group-in-0")
    delivery = ExactlyOnce(
        settings,
        OffsetTracker(),
        Edge({TP0, TP1}, transactions_only=True),
        Metrics(version="test"),
        transactions=Shared(None) if shared else per_partition(factory),
    )
    return delivery, factory


async def test_a_group_over_the_staged_bound_waits_for_room_then_returns() -> None:
    """More outcomes staged than the window holds: the group that passed the bound keeps
    its slots until a commit makes room (or its own results commit); within the bound a
    group returns at once, before its transaction."""
    delivery, factory = _small_window(4)
    await delivery.assigned({TP})
    records = [record(o) for o in range(6)]
    tickets = [delivery.track(r) for r in records]

    def group(start: int, end: int) -> asyncio.Task[None]:
        return asyncio.create_task(
            delivery.complete_many(
                [(r, b"in-%d" % r.offset, []) for r in records[start:end]], tickets[start:end]
            )
        )

    await group(0, 3)  # 3 staged of 4: returns before its commit
    assert delivery.offsets.commit_point(TP) == 3
    over = group(3, 6)  # 6 staged: over the bound, waits
    for _ in range(5):
        await asyncio.sleep(0)
    assert not over.done()
    await delivery.commit()
    await over  # room made (its own results committed too)
    committed = [v for p in factory.made for v in _values(p.committed)]
    assert committed == [b"in-%d" % o for o in range(6)]
    await delivery.close()


async def test_a_group_over_the_bound_returns_once_its_own_results_commit() -> None:
    """A partition stuck below its staged outcomes (a record of it not done) keeps the
    staging over the bound: a group of another partition still returns once its own
    results commit, as a record holding its slot until its transaction would."""
    delivery, _ = _small_window(2, shared=True)
    await delivery.assigned({TP0, TP1})
    stuck = [record(o, TP0) for o in range(4)]
    stuck_tickets = [delivery.track(r) for r in stuck]
    # Offset 0 is never done: offsets 1-3 stay staged, over the bound of 2.
    blocked = asyncio.create_task(
        delivery.complete_many([(r, b"a", []) for r in stuck[1:]], stuck_tickets[1:])
    )
    other = record(0, TP1)
    other_ticket = delivery.track(other)
    moving = asyncio.create_task(delivery.complete_many([(other, b"b", [])], [other_ticket]))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not blocked.done() and not moving.done()
    await delivery.commit()
    await moving  # its own result committed
    assert not blocked.done()  # still over the bound, its own not committed
    blocked.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await blocked
    await delivery.close()


class _Moving(Edge):
    """A consumer whose partition 0 moves away (a rebalance) when ``move`` is set."""

    def __init__(self) -> None:
        super().__init__(transactions_only=True)
        self.moved = False

    def owns(self, tp: TopicPartition) -> bool:
        return not self.moved

    def assignment(self) -> set[TopicPartition]:
        return set() if self.moved else set(self.partitions)


async def test_a_restart_retrying_never_initialises_the_id_once_the_partition_moved() -> None:
    """The producer closed by a failed transaction is restarted at the next commit; its
    first start finds the broker out of reach, and while it waits to try again the
    partition moves to another member: no second start (it would fence the new owner by
    initialising the partition's transactional id), no transaction, nothing committed."""
    edge = _Moving()
    starts: list[FakeProducer] = []

    def prepare(n: int, producer: FakeProducer) -> None:
        if n == 0:
            producer.commit_error = KafkaConnectionError()  # the first transaction fails
        elif n == 1:
            # The restart's first try: out of reach, and meanwhile the partition moves.
            def moved() -> None:
                edge.moved = True

            producer.start_error = KafkaConnectionError("down")
            producer.on_start = moved
        starts.append(producer)

    factory = Factory("kafka-triton-worker-group-in-0", prepare)
    delivery = await _started(factory, edge)
    task = await _complete(delivery, 0)
    await delivery.commit()  # fails: the producer is closed
    edge.moved = False
    await delivery.commit()  # the restart: one try, then the partition is gone
    assert len(factory.made) == 2
    assert [p.calls for p in factory.made[1:]] == [["start", "stop"]]
    assert not task.done()
    await delivery.revoked({TP})
    with pytest.raises(errors.PartitionRevoked):
        await task


async def test_a_partition_lost_while_its_acks_come_in_never_commits() -> None:
    """The partition leaves the assignment while the transaction waits for its acks: the
    transaction is abandoned before its offsets and commit (aiokafka sends no generation
    with them: a stale member would commit an older offset over the new owner's)."""
    edge = _Moving()

    def prepare(n: int, producer: FakeProducer) -> None:
        def moved() -> None:
            edge.moved = True

        producer.on_send = moved

    factory = Factory("kafka-triton-worker-group-in-0", prepare)
    delivery = await _started(factory, edge)
    task = await _complete(delivery, 0)
    await delivery.commit()
    made = factory.made[0]
    assert made.offsets == [] and "commit" not in made.calls
    assert made.calls[-2:] == ["abort", "stop"]
    assert not task.done()
    await delivery.close()
    with pytest.raises(errors.PartitionRevoked):
        await task


async def test_a_dead_letter_slimmed_twice_still_describes_its_original_value() -> None:
    """The dead-letter topic refuses a dead letter, then its slimmed form (the key is still
    too large): the third try has no value and no key, and one x-original-value-bytes and
    x-original-value-sha256, those of the original value (before, a second pair described
    the empty value)."""

    def prepare(n: int, producer: FakeProducer) -> None:
        if n < 2:
            producer.refuse = {0}

    factory = Factory("kafka-triton-worker-group-in-0", prepare)
    delivery = await _started(factory)
    rec = record(0)

    async def deliver() -> None:
        await delivery.publish_dead_letter(rec, [("x-error-code", b"DECODE_ERROR")])

    task = await completing(delivery, rec, deliver)
    for _ in range(3):
        await delivery.commit()
    await task
    [(topic, value, key, headers)] = factory.made[2].committed
    assert (topic, value, key) == ("dlq", b"", None)
    names = [name for name, _ in headers]
    assert names.count(X_ORIGINAL_VALUE_BYTES) == 1
    assert names.count(X_ORIGINAL_VALUE_SHA256) == 1
    assert dict(headers)[X_ORIGINAL_VALUE_BYTES] == b"1"  # record()'s value: b"v"
    await delivery.close()


# -- one producer for every partition (librdkafka) ------------------------------------


async def test_one_transaction_carries_every_partition() -> None:
    """Records of two partitions: one transaction, both results, both next offsets; each
    record's completion returns once it commits."""
    delivery, transactions = await _shared()
    producer = transactions.producer
    assert producer.starts == 1
    tasks = [await _complete(delivery, 0, TP0), await _complete(delivery, 5, TP1)]
    assert not any(task.done() for task in tasks)
    await delivery.commit()
    await asyncio.gather(*tasks)
    [(messages, offsets, one_by_one)] = producer.sent
    assert sorted(_values(messages), key=lambda value: value or b"") == [b"in-0", b"in-5"]
    assert offsets == {TP0: 1, TP1: 6} and not one_by_one
    assert delivery.offsets.commit_point(TP0) == 1
    await delivery.close()
    assert not producer.running


async def test_a_fenced_member_drops_its_partitions_and_their_records() -> None:
    """The group moved on: the transaction is fenced; the partitions it carried are dropped
    and their staged records end revoked (their next owner redoes them)."""
    delivery, transactions = await _shared()
    transactions.producer.endings = ["fenced"]
    task = await _complete(delivery, 0, TP0)
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
    delivery, transactions = await _shared()
    transactions.producer.endings = ["fenced"]
    task = await _complete(delivery, 0, TP0)
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
    task = await _complete(delivery, 2, TP0)
    await delivery.commit()
    await task
    await delivery.close()


async def test_a_rebalance_beginning_defers_the_transaction() -> None:
    """No transaction can begin (a rebalance began): nothing sent, nothing abandoned; the
    next commit carries it."""
    delivery, transactions = await _shared()
    producer = transactions.producer
    task = await _complete(delivery, 0, TP0)
    producer.defer = True
    await delivery.commit()
    assert producer.sent == [] and producer.abandoned == 0 and not task.done()
    producer.defer = False
    await delivery.commit()
    await task
    assert len(producer.sent) == 1
    await delivery.close()


async def test_a_batch_refused_for_size_is_sent_one_by_one_to_find_the_culprit() -> None:
    """Both results refused (one batch): the next transaction goes one by one; the one
    refused alone becomes OUTPUT_TOO_LARGE for its record, the other commits."""
    delivery, transactions = await _shared()
    producer = transactions.producer
    producer.endings = [(0, 1), (1,)]
    innocent, culprit = await _complete(delivery, 0, TP0), await _complete(delivery, 1, TP0)
    await delivery.commit()
    await delivery.commit()
    with pytest.raises(errors.OutputTooLarge):
        await culprit
    assert [one_by_one for _, _, one_by_one in producer.sent] == [False, True]
    assert not innocent.done()  # held until the culprit's dead letter is staged
    await delivery.close()
    with pytest.raises(errors.PartitionRevoked, match="closing"):
        await innocent  # ended by the close (a task left unawaited is logged when collected)


async def test_a_revocation_commits_what_is_done_and_keeps_the_producer() -> None:
    """Partition 1 revoked: its done records commit first; the producer stays for 0."""
    delivery, transactions = await _shared()
    producer = transactions.producer
    task = await _complete(delivery, 3, TP1)
    await delivery.revoked({TP1})
    await task
    assert [offsets for _, offsets, _ in producer.sent] == [{TP1: 4}]
    assert producer.running and set(delivery._partitions) == {TP0}
    await delivery.close()
    assert not producer.running


async def test_a_lost_partition_is_let_go_without_a_transaction() -> None:
    """Partition 1 lost (the session expired, the group moved on): no transaction for it
    (the broker would refuse its offsets after a wait of seconds, inside the callback);
    its staged record ends as revoked and its next owner redoes it."""
    delivery, transactions = await _shared()
    producer = transactions.producer
    task = await _complete(delivery, 3, TP1)
    await delivery.revoked({TP1}, lost=True)
    with pytest.raises(errors.PartitionRevoked, match="lost"):
        await task
    assert producer.sent == []
    assert producer.running and set(delivery._partitions) == {TP0}
    await delivery.close()


class _LosingMidway(Transactional):
    """A shared producer during whose send (``at="send"``, refusing the first record for
    size) or commit (``at="commit"``) the member loses partition 1."""

    def __init__(self, at: str) -> None:
        super().__init__()
        self.at = at
        self.delivery: ExactlyOnce | None = None

    async def _lose(self) -> None:
        assert self.delivery is not None
        await self.delivery.revoked({TP1}, lost=True)

    async def send(self, messages: Any, *, one_by_one: bool) -> tuple[int, ...]:
        await super().send(messages, one_by_one=one_by_one)
        if self.at == "send":
            await self._lose()
            return (0,)
        return ()

    async def commit(self) -> None:
        if self.at == "commit":
            await self._lose()
        await super().commit()


@pytest.mark.parametrize("at", ["send", "commit"])
async def test_a_partition_lost_amid_its_transaction_is_let_go_and_the_worker_goes_on(
    at: str,
) -> None:
    """Partition 1 is lost while its transaction is under way (its staged outcomes
    dropped at once, no lock waited for): a refusal for size names nothing of it any more,
    and a commit that went through settles nothing of it twice; its record ends as
    revoked, the commit loop goes on, and partition 0 commits as before."""
    producer = _LosingMidway(at)
    delivery, _ = await _shared_with(producer)
    producer.delivery = delivery
    lost = await _complete(delivery, 5, TP1)
    await delivery.commit()
    with pytest.raises(errors.PartitionRevoked, match="lost"):
        await lost
    assert set(delivery._partitions) == {TP0}
    producer.at = ""
    kept = await _complete(delivery, 3, TP0)
    await delivery.commit()
    await kept
    assert producer.sent[-1][1] == {TP0: 4}
    await delivery.close()


async def test_the_shared_producer_stops_at_close_with_no_partition_left() -> None:
    """Every partition revoked, then the worker closes: the producer kept for the next
    assignment is stopped all the same."""
    delivery, transactions = await _shared()
    await delivery.revoked({TP0, TP1})
    assert transactions.producer.running
    await delivery.close()
    assert not transactions.producer.running


async def test_a_window_half_full_of_staged_outcomes_commits_before_the_interval() -> None:
    """A record holds its window slot until its transaction commits: once half the window
    (WORKER_MAX_IN_FLIGHT 4: two outcomes) is staged, the commit loop commits at once
    rather than at the end of its 60 s interval."""
    settings = _settings(
        MAX_IN_FLIGHT="4", MAX_IN_FLIGHT_PER_PARTITION="2", COMMIT_INTERVAL_MS="60000"
    )
    transactions = Shared()
    delivery = ExactlyOnce(
        settings,
        OffsetTracker(),
        Edge({TP0, TP1}, transactions_only=True, fetches=False),
        Metrics(version="test"),
        transactions=transactions,
    )
    await delivery.assigned({TP0, TP1})
    loop = asyncio.create_task(delivery.commit_loop())
    first = await _complete(delivery, 0, TP0)
    await asyncio.sleep(0)
    assert transactions.producer.sent == []  # one staged: the interval rules
    second = await _complete(delivery, 0, TP1)
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert len(transactions.producer.sent) == 1
    loop.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await loop
    await delivery.close()


class _Rebalancing(Edge):
    """A consumer inside a rebalance callback: it owns nothing new, its partitions still
    assigned."""

    def owns(self, tp: TopicPartition) -> bool:
        return False


async def test_a_revocation_restarts_a_shared_producer_whose_start_fences_no_one() -> None:
    """librdkafka: a failed transaction closed the producer; the revocation's own commit
    (inside the rebalance callback, nothing owned) starts a fresh one and commits, since
    its id is the worker's own (before, it waited for the rebalance, which waited for the
    records: they stalled for the revocation's whole bound)."""
    edge = _Rebalancing({TP0, TP1}, transactions_only=True, fetches=False)
    delivery, transactions = await _shared(edge)
    producer = transactions.producer
    producer.endings = ["failed"]
    task = await _complete(delivery, 0, TP0)
    await delivery.commit()  # fails: the producer is closed
    assert not producer.running
    await delivery.revoked({TP0})
    await task
    assert producer.starts == 2 and [offsets for _, offsets, _ in producer.sent][-1] == {TP0: 1}
    await delivery.close()
