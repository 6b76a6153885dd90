"""``exactly_once`` on librdkafka: one transactional producer per worker, fenced by the group.

Outcomes are staged per partition as in ``exactly_once`` (the same staging, size
refusals and replacements); every commit interval the contiguous done prefix of
*every* partition goes into one transaction with the partitions' next offsets,
sent with the consumer's group metadata (KIP-447). A member that lost its
partitions (a zombie past its session, a hand-over it missed) has its offsets
refused by the group coordinator and its transaction aborted; a new owner starts
from the committed offsets through a stable offset fetch, which waits for a
transaction still pending on them. No per-partition producer, no fencing by
transactional id, no seek after assignment.

A failed transaction is aborted and the producer closed, its outcomes kept staged and
redone by the next commit on a fresh producer, as in ``exactly_once``; a commit that
fails with a retriable error is made again instead (see ``GroupTransactions``).

The transactional id names the group and the member's client id; a member's
transaction left open by a crash is aborted by the broker after
``transaction.timeout.ms`` (``TRANSACTION_TIMEOUT_MS``), and until then the
stable offset fetch holds that partition's new owner back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from worker.delivery.exactly_once import ExactlyOnce, _Partition
from worker.delivery.offsets import OffsetTracker
from worker.kafka.transactions import Message, ProducerStartFailed, TransactionOutcome
from worker.kafka.types import CommitEdge, TopicPartition

if TYPE_CHECKING:
    from worker.kafka.edge import GroupFenced
from worker.observability import Metrics
from worker.settings import Settings

__all__ = ["TRANSACTION_TIMEOUT_MS", "GroupEdge", "GroupFencedExactlyOnce"]

#: A partition in a transaction: its staging, its commit point, the offsets committed.
_Ready = tuple[TopicPartition, _Partition, int, list[int]]

log = structlog.get_logger(__name__)

#: The transactions' timeout: how long a crashed member's open transaction holds back
#: the new owner of its partitions (far above one transaction's duration).
TRANSACTION_TIMEOUT_MS = 10_000

#: Batch size of the transactional producer, aiokafka's default (as the per-partition
#: producers have): a topic refuses a whole batch over its ``max.message.bytes``, and a
#: refused batch fails the transaction, so larger batches of small results would be refused
#: together on a topic with a small limit, every transaction (and then sent one by one).
TRANSACTION_BATCH_BYTES = 16 * 1024


def _no_partition_producer(transactional_id: str) -> Any:
    """Never called: this mode has one producer for every partition, not one per partition."""
    raise AssertionError(f"no partition producer in the group-fenced mode ({transactional_id})")


class GroupEdge(CommitEdge, Protocol):
    """The consumer, with its group metadata for the transactions."""

    async def group_metadata(self) -> Any: ...


class GroupFencedExactlyOnce(ExactlyOnce):
    """exactly_once with one producer for every partition, fenced by the group generation."""

    def __init__(
        self,
        settings: Settings,
        offsets: OffsetTracker,
        edge: GroupEdge,
        metrics: Metrics,
        *,
        transactions: GroupFenced,
    ) -> None:
        super().__init__(settings, offsets, edge, metrics, new_producer=_no_partition_producer)
        self._group = edge
        kafka = settings.kafka
        transactional_id = (
            f"{settings.delivery.transactional_id_prefix}-{kafka.group_id}-{kafka.client_id}"
        )
        producer_config = transactions.producer_config
        self._txn = transactions.new_transactions(
            {
                **producer_config,
                "transactional.id": transactional_id,
                "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS,
                "batch.size": min(
                    producer_config.get("batch.size", TRANSACTION_BATCH_BYTES),
                    TRANSACTION_BATCH_BYTES,
                ),
            }
        )

        #: The last transaction was refused for size on several messages.
        self._suspects = False

    def transactional_id(self, tp: TopicPartition) -> str:
        """The worker's one transactional id (whatever the partition)."""
        return self._txn.transactional_id

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        """Start the producer once; each partition's state is ready at once (no seek:
        librdkafka fetches from the stable committed offsets)."""
        if not self._txn.running:
            try:
                await self._txn.start()
            except ProducerStartFailed as error:
                log.error("exactly_once_producer_unusable", error=str(error))
                self.fail(error)
                return
        for tp in sorted(partitions):
            if tp in self._partitions:
                continue
            part = _Partition(self._txn)  # type: ignore[arg-type]  # shared by every partition
            part.ready.set()
            self._partitions[tp] = part
        self._notify()

    async def commit(self, only: Iterable[TopicPartition] | None = None) -> None:
        """Commit every partition's staged done prefix with its offset, in one transaction
        (``only`` is ignored: the one transaction carries them all)."""
        txn = self._txn
        async with txn.lock:
            batch = self._ready()
            if not batch:
                return
            if not txn.running:
                try:
                    await txn.replace()
                except ProducerStartFailed as error:
                    self.fail(error)
                    return
            messages: list[Message] = [
                m for _, part, _, ready in batch for o in ready for m in part.staged[o].messages
            ]
            try:
                group = await self._group.group_metadata()
            except Exception as exc:  # a rebalance began: the next flush tries again
                log.info("transaction_deferred", error=f"{type(exc).__name__}: {exc}")
                return
            outcome = await txn.run_transaction(
                messages, {tp: point for tp, _, point, _ in batch}, group, one_by_one=self._suspects
            )
            if not self._settle(batch, outcome):
                return
        for tp, part, point, ready in batch:
            for offset in ready:
                staged = part.staged.pop(offset)
                if not staged.committed.done():
                    staged.committed.set_result(None)
            self.offsets.mark_committed({tp: point})
        self._metrics.transactions_total.inc()
        self._metrics.commits_total.inc()

    def _ready(self) -> list[_Ready]:
        """Each partition with a staged done prefix: its commit point and the offsets in it."""
        batch: list[_Ready] = []
        for tp, part in self._partitions.items():
            point = self.offsets.commit_point(tp)
            if point is None:
                continue
            point = min([point, *part.replacing])
            ready = sorted(o for o in part.staged if o < point)
            if ready:
                batch.append((tp, part, point, ready))
        return batch

    def _settle(self, batch: list[_Ready], outcome: TransactionOutcome) -> bool:
        """Act on a transaction's outcome; True when it committed."""
        if outcome.fenced:
            for tp, part, _, _ in batch:
                self._drop(tp, part, "fenced: the group has moved on")
            return False
        if len(outcome.too_large) > 1:
            # A refused batch names every message in it, the innocent too: the next
            # transaction sends them one by one to find the one(s) too large.
            self._suspects = True
            return False
        if outcome.too_large:
            self._suspects = False
            start = 0
            for _, part, _, ready in batch:
                count = sum(len(part.staged[o].messages) for o in ready)
                mine = tuple(i - start for i in outcome.too_large if start <= i < start + count)
                if mine:
                    self._replace_refused(part, ready, mine)
                start += count
            return False
        if not outcome.committed:
            self._metrics.commit_failures_total.inc()
            return False
        self._suspects = False
        return True

    async def revoked(self, partitions: set[TopicPartition]) -> None:
        """Commit what is done (the member still owns them), then forget them; the producer
        stays for the partitions that remain."""
        await self.commit()
        for tp in partitions:
            part = self._partitions.get(tp)
            if part is not None:
                self._drop(tp, part, "revoked")
        self.forget(partitions)
        self._notify()

    async def close(self) -> None:
        for tp, part in list(self._partitions.items()):
            self._drop(tp, part, "closing")
        async with self._txn.lock:
            await self._txn.stop()
