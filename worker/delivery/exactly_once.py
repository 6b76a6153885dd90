"""``exactly_once``: outcomes and offsets in Kafka transactions, on either client.

Outcomes are staged per input partition as records finish; every commit interval the
contiguous done prefix of each partition is written, with the next offset to consume,
in one transaction per transactional producer. Which producer carries a partition is
the client's (``worker.kafka.transactions.Transactions``): one per input partition,
fenced by its transactional id (aiokafka), or one for every partition, fenced by the
group generation (librdkafka). A record's ``deliver`` returns once its transaction
commits, so it holds its window slot until then, while ordering turns pass on as soon as
it is staged. A group's results (``complete_many``) give their slots back as soon as they
are staged, while no more outcomes are staged than the window holds; past that, the
group waits for a commit to make room (or for its own to end). The window then bounds
the records being inferred, and the same count the outcomes waiting for their
transaction: a transaction carries up to half of both, and inference goes on while it
commits.

A partition is ours to commit only while it is held here and assigned to the consumer:
that is checked again after every wait (a producer's start, which may retry for a
minute; the acknowledgements) and before every commit, and a producer is (re)started,
which fences the previous holders of its transactional id, only while no rebalance is
under way. A partition lost meanwhile never commits: its next owner redoes its records.

A failed transaction (a result the topic refuses for its size, a broker restart, offsets
refused while the group rebalances) is abandoned: aborted and its producer closed; its
outcomes stay staged, and records that finish while the producer is closed are staged
as well. The next commit starts a fresh producer and writes them all in a new
transaction: the same member redoes them at once, never waiting for a rebalance.
Re-staging rather than seeking back and processing again: no second inference. An
aborted transaction is invisible to ``read_committed`` readers, so writing its outcomes
again is still exactly once. Only a partition gone (revoked, fenced) ends its records
here; its next owner redoes them.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import structlog

from worker import wire
from worker.delivery.base import CommitEdge, OnSafe, Refused, Sink, Then, TrackingDelivery
from worker.delivery.offsets import OffsetTracker
from worker.errors import OutputTooLarge, PartitionRevoked, WriteFailed
from worker.kafka.publisher import dead_letter_value
from worker.kafka.transactions import (
    Message,
    ProducerStartFailed,
    TransactionalProducer,
    TransactionDeferred,
    TransactionFailed,
    Transactions,
)
from worker.kafka.types import ConsumerRecord, TopicPartition
from worker.observability import Metrics
from worker.settings import Settings
from worker.wire import Headers
from worker.wire.headers import X_VALUE_OMITTED

__all__ = ["ExactlyOnce"]

log = structlog.get_logger(__name__)


class _Waiter:
    """Who waits for staged outcomes to commit: one record's own path, or a group of
    results (one future for them all; each one refused or gone told to ``on_refused`` at
    once, the others' indexes kept for its audit)."""

    __slots__ = ("committed", "future", "on_refused", "remaining")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_refused: Refused | None) -> None:
        #: Set once every outcome is settled; a record's own fails with its refusal.
        self.future: asyncio.Future[None] = loop.create_future()
        self.on_refused = on_refused
        self.remaining = 0
        self.committed: list[int] = []

    def settle(self, index: int, error: BaseException | None) -> None:
        self.remaining -= 1
        if error is None:
            self.committed.append(index)
        elif self.on_refused is None:
            if not self.future.done():
                self.future.set_exception(error)
        else:
            try:
                self.on_refused(index, error)
            except Exception:  # a bug of the caller's: it must not stop the commits
                log.exception("refusal_not_told", index=index)
        if self.remaining <= 0 and not self.future.done():
            self.future.set_result(None)


@dataclass(slots=True)
class _Staged:
    record: ConsumerRecord[bytes, bytes]
    messages: list[Message]
    waiter: _Waiter
    index: int  # in its waiter's group
    is_result: bool  # a refusal for size turns it into a dead letter
    settled: bool = False

    def settle(self, error: BaseException | None = None) -> None:
        """Committed (no error), or its outcome must change (refused, partition gone)."""
        if not self.settled:
            self.settled = True
            self.waiter.settle(self.index, error)


@dataclass
class _Partition:
    producer: TransactionalProducer
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # may commit, or gone
    staged: dict[int, _Staged] = field(default_factory=dict)
    #: Offsets whose outcome was refused and awaits its replacement (a dead letter).
    replacing: set[int] = field(default_factory=set)


@dataclass
class _Ready:
    """A partition in a transaction: its commit point and the staged offsets before it."""

    tp: TopicPartition
    part: _Partition
    point: int
    offsets: list[int]


class _Ended(enum.Enum):
    """How a transaction ended, when it did not commit."""

    DEFERRED = "deferred"  # nothing begun: a rebalance is under way
    FAILED = "failed"  # abandoned; the next commit tries again on a fresh producer
    FENCED = "fenced"  # another member owns the partitions now
    LOST = "lost"  # a partition is no longer ours: abandoned before its commit
    TOO_LARGE = "too_large"  # records refused for size (named in the refusal)


class _Lost(Exception):
    """A partition of the transaction is no longer ours."""


def _tp(record: ConsumerRecord[bytes, bytes]) -> TopicPartition:
    return TopicPartition(record.topic, record.partition)


class ExactlyOnce(TrackingDelivery):
    """The exactly_once mode: stage outcomes per partition, commit them with their offsets."""

    def __init__(
        self,
        settings: Settings,
        offsets: OffsetTracker,
        edge: CommitEdge,
        metrics: Metrics,
        *,
        transactions: Transactions,
    ) -> None:
        super().__init__(
            offsets,
            edge,
            metrics,
            settings.kafka.commit_interval_ms / 1000,
            settings.delivery.max_uncommitted_per_partition,
        )
        self._topics = settings.topics
        self._transactions = transactions
        #: Outcomes staged and not committed yet, and how many wake the commit loop before
        #: its interval: a record holds its window slot until its transaction commits, so a
        #: window half full of staged outcomes waiting for the interval would idle the rest.
        self._staged_count = 0
        self._commit_at = max(1, settings.flow.max_in_flight // 2)
        #: A group's results give their window slots back once staged while no more than
        #: this many outcomes are staged (``complete_many``): the window then bounds the
        #: records being inferred, and this the outcomes waiting for their transaction.
        self._staged_limit = max(1, settings.flow.max_in_flight)
        #: Settled when staged outcomes fall to the limit (callers of complete_many wait).
        self._room: asyncio.Future[None] | None = None
        self._partitions: dict[TopicPartition, _Partition] = {}
        #: Every producer not stopped yet (a shared one outlives its partitions).
        self._producers: dict[int, TransactionalProducer] = {}
        self._on_staged: dict[tuple[TopicPartition, int], OnSafe] = {}
        #: Partitions dropped while still assigned (fenced): the generation and the reason.
        #: Their records end at once instead of waiting for the revocation, which itself
        #: waits for them. One entry per assigned partition at most, gone when forgotten.
        self._released: dict[TopicPartition, tuple[int, str]] = {}
        #: Producers whose last transaction was refused for size on several records that
        #: may have shared a batch: the next one sends them one by one to find which.
        self._suspects: set[int] = set()
        # Set (and replaced) when a partition is added or dropped, or its tracking forgotten.
        self._changed = asyncio.Event()

    @property
    def sink(self) -> Sink:
        return self

    def not_ready(self) -> list[str]:
        return sorted(str(tp) for tp, p in self._partitions.items() if not p.ready.is_set())

    # -- records -------------------------------------------------------------------

    async def complete(
        self,
        record: ConsumerRecord[bytes, bytes],
        ticket: int,
        deliver: Callable[[], Awaitable[None]],
        on_safe: OnSafe,
    ) -> None:
        tp = TopicPartition(record.topic, record.partition)
        part = await self._partition_of(tp, ticket)
        await part.ready.wait()
        # Only a partition gone (revoked, fenced, unusable) ends the record here. A producer
        # closed after a failed transaction does not: the outcome is staged all the same,
        # and the next flush starts a fresh producer for it.
        if self._partitions.get(tp) is not part:
            raise PartitionRevoked(str(tp))
        # A record whose result its group's transaction refused is done already: its
        # partition's commit stays below it until its dead letter is staged.
        if record.offset not in part.replacing and not self.offsets.done(tp, record.offset, ticket):
            raise PartitionRevoked(str(tp))
        # Done when staged (deliver stages it before its first pause); deliver returns
        # once the transaction carrying the outcome and the offset has committed.
        self._on_staged[(tp, record.offset)] = on_safe
        try:
            await deliver()
        finally:
            self._on_staged.pop((tp, record.offset), None)

    async def complete_many(
        self,
        results: Sequence[tuple[ConsumerRecord[bytes, bytes], bytes, Headers]],
        tickets: Sequence[int],
        *,
        on_safe: OnSafe = lambda: None,
        on_refused: Refused = lambda _i, _e: None,
        then: Then | None = None,
    ) -> None:
        """Stage every result in its partition's next transaction (each partition's in the
        order given) and mark them done; ``on_safe`` once all are staged; a result refused
        (for its size: its dead letter must follow at once) or whose partition went is told
        to ``on_refused`` as soon as it is known. Return once the staged outcomes are within
        the bound (the window's size), or once the results have committed, whichever comes
        first; with ``then``, once they have committed (``then`` awaited first). A refusal
        after the return is told all the same."""
        parts: dict[TopicPartition, _Partition | None] = {}
        for tp, ticket in {(_tp(r), t) for (r, _, _), t in zip(results, tickets, strict=True)}:
            try:
                part = await self._partition_of(tp, ticket)
                await part.ready.wait()
            except PartitionRevoked:
                part = None
            parts[tp] = part if self._partitions.get(tp) is part else None
        output = self._topics.output_topic
        waiter = _Waiter(asyncio.get_running_loop(), on_refused)
        for i, ((record, value, headers), ticket) in enumerate(zip(results, tickets, strict=True)):
            tp = _tp(record)
            part = parts[tp]
            if part is None or not self.offsets.done(tp, record.offset, ticket):
                on_refused(i, PartitionRevoked(str(tp)))
                continue
            messages: list[Message] = [(output, value, record.key, headers)]
            self._put(part, record, messages, waiter, i, is_result=True)
        on_safe()
        while waiter.remaining > 0:
            if then is None and self._staged_count <= self._staged_limit:
                # Staged within the bound: the records' slots go back now; a result refused
                # at its commit is told to ``on_refused`` then.
                return
            waits = [waiter.future] if then is not None else [waiter.future, self._room_future()]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if then is not None and waiter.committed:
            await then(sorted(waiter.committed))

    def _room_future(self) -> asyncio.Future[None]:
        room = self._room
        if room is None or room.done():
            room = self._room = asyncio.get_running_loop().create_future()
        return room

    def _unstaged(self, count: int) -> None:
        """``count`` outcomes left the staging (committed, replaced, dropped)."""
        self._staged_count -= count
        room = self._room
        if room is not None and self._staged_count <= self._staged_limit:
            self._room = None
            if not room.done():
                room.set_result(None)

    async def _partition_of(self, tp: TopicPartition, ticket: int) -> _Partition:
        """The record's partition state; PartitionRevoked once the record's assignment ended.

        Records can be fetched before the assignment callback has created the state:
        they wait for it (never for a partition that has moved away meanwhile).
        """
        while tp not in self._partitions and self.offsets.generation(tp) == ticket:
            released = self._released.get(tp)
            if released is not None and released[0] == ticket:
                raise PartitionRevoked(f"{tp}: {released[1]}")
            await self._changed.wait()
        part = self._partitions.get(tp)
        if part is None or self.offsets.generation(tp) != ticket:
            raise PartitionRevoked(str(tp))
        return part

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # -- the sink --------------------------------------------------------------------

    async def publish_result(
        self, record: ConsumerRecord[bytes, bytes], value: bytes, headers: Headers
    ) -> None:
        topic = self._topics.output_topic
        await self._stage(record, [(topic, value, record.key, headers)], is_result=True)

    async def publish_results(
        self, record: ConsumerRecord[bytes, bytes], results: Sequence[tuple[bytes, Headers]]
    ) -> None:
        topic = self._topics.output_topic
        messages: list[Message] = [(topic, v, record.key, h) for v, h in results]
        await self._stage(record, messages, is_result=True)

    async def publish_dead_letter(
        self, record: ConsumerRecord[bytes, bytes], headers: Headers
    ) -> None:
        value = dead_letter_value(record.value, record.key)
        topic = self._topics.dlq_topic
        await self._stage(record, [(topic, value, record.key, headers)], is_result=False)

    async def _stage(
        self, record: ConsumerRecord[bytes, bytes], messages: list[Message], *, is_result: bool
    ) -> None:
        tp = _tp(record)
        part = self._partitions.get(tp)
        if part is None:
            raise PartitionRevoked(str(tp))
        waiter = _Waiter(asyncio.get_running_loop(), None)
        self._put(part, record, messages, waiter, 0, is_result=is_result)
        on_staged = self._on_staged.pop((tp, record.offset), None)
        if on_staged is not None:
            on_staged()
        await waiter.future

    def _put(
        self,
        part: _Partition,
        record: ConsumerRecord[bytes, bytes],
        messages: list[Message],
        waiter: _Waiter,
        index: int,
        *,
        is_result: bool,
    ) -> None:
        """Stage the record's messages for its partition's next transaction; ``waiter`` is
        told when that transaction has committed (or the record's outcome must change)."""
        assert record.offset not in part.staged, f"{_tp(record)}@{record.offset} staged twice"
        part.replacing.discard(record.offset)
        part.staged[record.offset] = _Staged(record, messages, waiter, index, is_result)
        waiter.remaining += 1
        self._staged_count += 1
        if self._staged_count >= self._commit_at:
            self.commit_soon()

    # -- commits ---------------------------------------------------------------------

    async def commit(self, only: Iterable[TopicPartition] | None = None) -> None:
        """Commit the staged done prefix of each partition (of ``only``) with its offset,
        one transaction per producer, the producers' transactions side by side (one round
        trip of the slowest, not the sum of them: the records hold their window slots until
        it ends). Every transaction runs to its end before the first failure is raised."""
        wanted = set(only) if only is not None else None
        producers = {
            id(part.producer): part.producer
            for tp, part in self._partitions.items()
            if wanted is None or tp in wanted
        }
        ended = await asyncio.gather(
            *(self._flush(producer, wanted) for producer in producers.values()),
            return_exceptions=True,
        )
        for outcome in ended:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _flush(
        self, producer: TransactionalProducer, wanted: set[TopicPartition] | None
    ) -> None:
        async with producer.lock:
            batch = self._ready(producer, wanted)
            if batch and not producer.running:
                if not await self._restart(producer, batch):
                    return
                batch = self._ready(producer, wanted)  # partitions may have gone meanwhile
            if not batch:
                return
            ended = await self._transaction(producer, batch)
            if ended is not None:
                return
            for ready in batch:
                if self._dropped(ready):
                    continue  # lost while the commit was under way: _drop settled them
                self._unstaged(len(ready.offsets))
                staged = ready.part.staged
                for offset in ready.offsets:
                    staged.pop(offset).settle()
                self.offsets.mark_committed({ready.tp: ready.point})
        self._metrics.transactions_total.inc()
        self._metrics.commits_total.inc()

    def _ready(
        self, producer: TransactionalProducer, wanted: set[TopicPartition] | None
    ) -> list[_Ready]:
        """The producer's partitions with a staged done prefix (a refused outcome holds its
        partition's commit until its dead letter is staged)."""
        batch: list[_Ready] = []
        for tp, part in self._partitions.items():
            if part.producer is not producer or not part.ready.is_set():
                continue
            if wanted is not None and tp not in wanted:
                continue
            point = self.offsets.commit_point(tp)
            if point is None:
                continue
            point = min([point, *part.replacing])
            offsets = sorted(o for o in part.staged if o < point)
            if offsets:
                batch.append(_Ready(tp, part, point, offsets))
        return batch

    async def _transaction(
        self, producer: TransactionalProducer, batch: list[_Ready]
    ) -> _Ended | None:
        """One transaction of the batch's outcomes and offsets; None once it committed."""
        messages = [m for r in batch for o in r.offsets for m in r.part.staged[o].messages]
        try:
            await producer.begin()
        except TransactionDeferred as exc:
            log.info("transaction_deferred", error=str(exc))
            return _Ended.DEFERRED
        key = id(producer)
        try:
            refused = await producer.send(messages, one_by_one=key in self._suspects)
            if refused:
                await producer.abandon(f"refused for size: {len(refused)} record(s)")
                if any(self._dropped(ready) for ready in batch):
                    # Lost meanwhile (dropped with no lock waited for): the refusal's
                    # indexes no longer match what is staged; the next transaction of
                    # what is left finds the refused record again.
                    return _Ended.LOST
                return self._refused(producer, batch, refused)
            self._check_ours(batch)  # after the acknowledgements' wait
            await producer.send_offsets({r.tp: r.point for r in batch})
            self._check_ours(batch)  # and before the commit
            await producer.commit()
        except _Lost as exc:
            await producer.abandon(f"partition no longer ours: {exc}")
            return _Ended.LOST
        except TransactionFailed as exc:
            await producer.abandon(str(exc))
            if exc.fenced:
                for ready in batch:
                    self._drop(ready.tp, ready.part, "fenced: another member owns it now")
                return _Ended.FENCED
            self._metrics.commit_failures_total.inc()
            return _Ended.FAILED
        self._suspects.discard(key)
        return None

    def _dropped(self, ready: _Ready) -> bool:
        """The partition was dropped here (lost, revoked, fenced) since ``ready`` was made."""
        return self._partitions.get(ready.tp) is not ready.part

    def _check_ours(self, batch: list[_Ready]) -> None:
        """_Lost when a partition was dropped here or left the consumer's assignment."""
        assigned = self._edge.assignment()
        for ready in batch:
            if self._dropped(ready) or ready.tp not in assigned:
                raise _Lost(str(ready.tp))

    def _refused(
        self, producer: TransactionalProducer, batch: list[_Ready], refused: tuple[int, ...]
    ) -> _Ended:
        """Outcomes refused for size: named exactly, they are replaced; else the next
        transaction sends them one by one to find which."""
        key = id(producer)
        if len(refused) > 1 and not producer.exact_refusals:
            self._suspects.add(key)
            return _Ended.TOO_LARGE
        self._suspects.discard(key)
        start = 0
        for ready in batch:
            count = sum(len(ready.part.staged[o].messages) for o in ready.offsets)
            mine = tuple(i - start for i in refused if start <= i < start + count)
            if mine:
                self._replace_refused(ready.part, ready.offsets, mine)
            start += count
        return _Ended.TOO_LARGE

    def _replace_refused(
        self, part: _Partition, ready: list[int], refused: tuple[int, ...]
    ) -> None:
        """Outcomes the broker refused for size: results become OUTPUT_TOO_LARGE dead
        letters (through the record's own path), dead letters lose their value."""
        index_of: list[int] = [o for o in ready for _ in part.staged[o].messages]
        for offset in sorted({index_of[i] for i in refused}):
            staged = part.staged[offset]
            if staged.is_result:
                del part.staged[offset]
                self._unstaged(1)
                part.replacing.add(offset)
                staged.settle(
                    OutputTooLarge(f"result of {staged.record.topic}@{offset} is larger than "
                                   f"{self._topics.output_topic!r} accepts")
                )  # fmt: skip
            else:
                staged.messages = [self._slimmer(staged, m) for m in staged.messages]

    def _slimmer(self, staged: _Staged, message: Message) -> Message:
        """The dead letter without its value; refused again, without its key too."""
        topic, value, key, headers = message
        omitted = any(name == X_VALUE_OMITTED for name, _ in headers)
        if omitted and key is None:
            error = WriteFailed(
                f"{topic!r} refuses the dead letter of {wire.Source.of(staged.record)} even "
                "without its value and key; raise the topic's max.message.bytes"
            )
            staged.settle(error)
            self.fail(error)
            return message
        if not omitted:
            self._metrics.dead_letter_values_omitted_total.inc()
        slim_headers = wire.omitted_value_headers(headers, value, key, drop_key=omitted)
        return (topic, b"", None if omitted else key, slim_headers)

    # -- assignment ------------------------------------------------------------------

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        """Start each partition's producer; where the client asks it, read the committed
        offsets and seek to them; only then may the partitions commit.

        The order is the fencing on aiokafka: initialising a partition's id completes or
        aborts the previous owner's open transaction, so the offset read afterwards is
        final. A partition whose producer started first must not commit before that read
        either: records fetched meanwhile would be done and committed, the read would
        find this member's own commit, take it for a previous owner's, and seek back to
        it, so that records still staged were fetched and staged a second time (a fresh
        worker with a backlog stopped on "staged twice", exit 3).
        """
        added = []
        for tp in sorted(partitions):
            if tp in self._partitions:
                continue
            part = _Partition(self._transactions.producer_for(tp))
            self._partitions[tp] = part
            self._producers[id(part.producer)] = part.producer
            self._notify()
            if await self._start(tp, part):
                added.append(part)
        if self._transactions.seeks_committed:
            await self._seek_committed(partitions)
        for part in added:
            part.ready.set()

    async def _start(self, tp: TopicPartition, part: _Partition) -> bool:
        """The partition's producer started (at once when it runs already); False when it
        cannot start or the partition went meanwhile."""
        producer = part.producer
        async with producer.lock:
            if producer.running:
                return True
            return await self._started(producer, [(tp, part)], lambda: True)

    async def _restart(self, producer: TransactionalProducer, batch: list[_Ready]) -> bool:
        """A fresh producer for a batch. Where its start fences whoever held its id before
        (the partition's new owner), only while every partition of the batch is owned and
        no rebalance is under way (a rebalance is deciding: the revocation cleans up);
        else at once (a revocation's own commit too: its records are not left waiting for
        the revocation, which waits for them)."""
        held = [(r.tp, r.part) for r in batch]
        if not self._transactions.start_fences:
            return await self._started(producer, held, lambda: True)
        return await self._started(
            producer, held, lambda: all(self._edge.owns(tp) for tp, _ in held)
        )

    async def _started(
        self,
        producer: TransactionalProducer,
        held: list[tuple[TopicPartition, _Partition]],
        owned: Callable[[], bool],
    ) -> bool:
        """Start the producer while the partitions are held here and ``owned()`` (asked
        before every try); one that cannot start drops them and stops the worker (a
        rebalance callback cannot raise: aiokafka drops what it raises)."""

        def still_ours() -> bool:
            return owned() and all(self._partitions.get(tp) is part for tp, part in held)

        try:
            return await producer.start(still_ours)
        except ProducerStartFailed as error:
            log.error("exactly_once_producer_unusable", error=str(error))
            for tp, part in held:
                self._drop(tp, part, str(error))
            self.fail(error)
            return False

    async def _seek_committed(self, partitions: set[TopicPartition]) -> None:
        ours = [tp for tp in partitions if tp in self._partitions]
        if not ours:
            return
        committed = await self._edge.fetch_committed(ours)
        for tp in ours:
            meta = committed.get(tp)
            if meta is None or meta.offset < 0:
                continue  # no commit yet: the consumer's offset reset applies
            state = self.offsets.get(tp)
            if state is not None:
                if state.start == meta.offset:
                    continue  # fetching already started from the final offset
                # Fetched from an offset read before the previous owner's transaction
                # ended: what was dispatched from there is stale.
                self.offsets.revoke(tp)
                self._notify()
            self._edge.seek(tp, meta.offset)

    async def revoked(self, partitions: set[TopicPartition], *, lost: bool = False) -> None:
        """Commit what is done of them (the member still owns them; not when ``lost``: a
        transaction would be refused, after a wait, for the generation gone), then forget
        them; a partition's own producer is stopped, a shared one stays for the others."""
        if not lost:
            await self.commit(only=partitions)
        for tp in sorted(partitions):
            part = self._partitions.get(tp)
            if part is None:
                continue
            if not self._transactions.shared:
                async with part.producer.lock:
                    await part.producer.stop()
                self._producers.pop(id(part.producer), None)
            self._drop(tp, part, "lost" if lost else "revoked")
        self.forget(partitions)
        self._notify()

    def _drop(self, tp: TopicPartition, part: _Partition, why: str) -> None:
        """Forget the partition: waiters see it gone, staged outcomes are redone elsewhere."""
        if self._partitions.get(tp) is part:
            del self._partitions[tp]
            generation = self.offsets.generation(tp)
            if generation is not None:
                self._released[tp] = (generation, why)
        part.ready.set()
        gone = list(part.staged.values())
        self._unstaged(len(gone))
        part.staged.clear()
        for staged in gone:
            staged.settle(PartitionRevoked(f"{tp}: {why}"))
        self._notify()
        log.info("exactly_once_partition_released", partition=str(tp), reason=why)

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        partitions = set(partitions)
        super().forget(partitions)
        for tp in partitions:
            self._released.pop(tp, None)

    async def close(self) -> None:
        for tp, part in list(self._partitions.items()):
            self._drop(tp, part, "closing")
        producers, self._producers = list(self._producers.values()), {}
        for producer in producers:
            async with producer.lock:
                await producer.stop()
