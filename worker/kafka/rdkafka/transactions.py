"""Transactions on librdkafka: one transactional producer per worker, fenced by the group.

``send_offsets_to_transaction`` carries the consumer's group metadata (group
generation or member epoch, member id; KIP-447): the group coordinator refuses the offsets of
a member that is no longer in the generation that owns the partitions, and the
transaction is aborted, so a zombie's outcomes never become visible. A new owner
reads the committed offsets with a stable offset fetch (librdkafka asks for it
under ``read_committed``), which waits for any transaction still pending on them.
So one producer per worker carries every partition (``shared``), and no seek follows
an assignment.

The transactional id is ``<prefix>-<group>-<client id>-<instance>``, the instance drawn
once per process: fencing is the group's, so the id need not be stable, and it must be
unique. Members sharing a client id (one set for quotas) would otherwise fence each
other's producer at every start, each of them in turn, for ever. A member's transaction
left open by a crash is aborted by the broker after ``transaction.timeout.ms``
(``TRANSACTION_TIMEOUT_MS``); until then the stable offset fetch holds that
partition's new owner back.

A record refused before it is queued (the transaction can take no more: ``_STATE``,
``_FATAL``; a topic gone: ``_UNKNOWN_TOPIC``) fails the transaction like a record
refused by the broker. A commit that fails with a retriable error (``_TIMED_OUT``: the
commit goes on in the background, and the coordinator may have accepted it) is made
again, never followed by an abort: outcomes sent again after a commit that went through
would be duplicates.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import secrets
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import confluent_kafka
import structlog
from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from aiokafka.structs import TopicPartition

from worker.flow.retry import Backoff
from worker.kafka.rdkafka.publisher import RdProducer
from worker.kafka.rdkafka.threads import in_thread
from worker.kafka.transactions import (
    START_ATTEMPTS,
    START_BACKOFF,
    Message,
    ProducerStartFailed,
    TransactionDeferred,
    TransactionFailed,
)

__all__ = [
    "TRANSACTION_TIMEOUT_MS",
    "GroupFencedTransactions",
    "GroupProducer",
    "transactional_config",
]

log = structlog.get_logger(__name__)

#: The transactions' timeout: how long a crashed member's open transaction holds back
#: the new owner of its partitions (far above one transaction's duration).
TRANSACTION_TIMEOUT_MS = 10_000

#: Batch size of the transactional producer, aiokafka's default (as the per-partition
#: producers have): a topic refuses a whole batch over its ``max.message.bytes``, and a
#: refused batch fails the transaction, so larger batches of small results would be refused
#: together on a topic with a small limit, every transaction (and then sent one by one).
TRANSACTION_BATCH_BYTES = 16 * 1024

#: Bound on one transactional call (init, offsets, commit, abort).
_CALL_TIMEOUT_S = 30.0
#: Wait before a commit that failed with a retriable error is made again.
_COMMIT_RETRY_BACKOFF = Backoff(first_s=0.1, max_s=2.0)
#: Timeout of send_offsets_to_transaction (a few round trips when the coordinators
#: answer), and how much longer it may run before the transaction is given up: librdkafka
#: does not always honour that timeout (its issue 5456: while the group coordinator is out
#: of reach, after a broker restart, the call was seen blocking for more than 40 s; it
#: waits for a change of broker state that may never come, so only a fresh producer gets
#: out, and the sooner the better: every partition waits meanwhile).
_OFFSETS_TIMEOUT_S = 2.5
_OFFSETS_GRACE_S = 0.5

#: The group coordinator refused the offsets: this member no longer owns the partitions.
#: (A rebalance in progress or a stale member epoch is not: the transaction is aborted
#: and tried again with the metadata read afresh.)
_GROUP_FENCED = {
    confluent_kafka.KafkaError.ILLEGAL_GENERATION,
    confluent_kafka.KafkaError.UNKNOWN_MEMBER_ID,
    confluent_kafka.KafkaError.FENCED_INSTANCE_ID,
    confluent_kafka.KafkaError.FENCED_MEMBER_EPOCH,
    confluent_kafka.KafkaError._ASSIGNMENT_LOST,
}

#: Reads the consumer's group metadata (raises while a rebalance is under way).
GroupMetadata = Callable[[], Awaitable[Any]]


def transactional_config(
    producer_config: Mapping[str, Any], *, prefix: str, group_id: str, client_id: str
) -> dict[str, Any]:
    """The worker's producer configuration made transactional, with an id of its own."""
    instance = secrets.token_hex(4)
    return {
        **producer_config,
        "transactional.id": f"{prefix}-{group_id}-{client_id}-{instance}",
        "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS,
        "batch.size": min(
            producer_config.get("batch.size", TRANSACTION_BATCH_BYTES), TRANSACTION_BATCH_BYTES
        ),
    }


class GroupFencedTransactions:
    """librdkafka's ``Transactions``: the worker's one producer, fenced by the group."""

    seeks_committed = False
    shared = True
    start_fences = False

    def __init__(self, config: Mapping[str, Any], group_metadata: GroupMetadata) -> None:
        """``config``: a complete transactional configuration (``transactional_config``)."""
        self.producer = GroupProducer(config, group_metadata)

    def producer_for(self, tp: TopicPartition) -> GroupProducer:
        return self.producer


class GroupProducer:
    """The worker's transactional producer: one transaction at a time, under ``lock``."""

    def __init__(self, config: Mapping[str, Any], group_metadata: GroupMetadata) -> None:
        self.transactional_id = str(config["transactional.id"])
        self._config = dict(config)
        self._group_metadata = group_metadata
        self._rd: RdProducer | None = None
        #: The group metadata read when the open transaction began.
        self._group: Any = None
        #: Producers closed after a failure, still being destroyed (``stop`` waits for them).
        self._retired: set[asyncio.Task[None]] = set()
        self.lock = asyncio.Lock()

    #: Its batches hold several records: a refusal names every record of the batch.
    exact_refusals = False

    @property
    def running(self) -> bool:
        return self._rd is not None

    async def start(self, still_ours: Callable[[], bool] = lambda: True) -> bool:
        """Start and initialise the transactional id (which aborts what a previous producer
        of the same id left open); retry a broker out of reach, not a refused id."""
        for attempt in range(1, START_ATTEMPTS + 1):
            if not still_ours():
                return False
            rd = RdProducer(self._config)
            try:
                await rd.start()
                await in_thread(rd.handle.init_transactions, _CALL_TIMEOUT_S)
            except (KafkaError, confluent_kafka.KafkaException) as exc:
                await _stop_quietly(rd)
                error = exc.args[0] if isinstance(exc, confluent_kafka.KafkaException) else None
                code = error.code() if isinstance(error, confluent_kafka.KafkaError) else None
                if code == confluent_kafka.KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED:
                    raise ProducerStartFailed(
                        f"exactly_once: the broker refuses transactional id "
                        f"{self.transactional_id!r}: grant Write and Describe on the "
                        "transactional ids (WORKER_TRANSACTIONAL_ID_PREFIX*)"
                    ) from None
                log.warning("transactional_producer_start_failed", attempt=attempt, error=str(exc))
                if attempt == START_ATTEMPTS:
                    raise ProducerStartFailed(
                        f"exactly_once: the transactional producer did not start after "
                        f"{attempt} tries: {exc}"
                    ) from None
                await asyncio.sleep(START_BACKOFF.delay_s(attempt))
                continue
            self._rd = rd
            return True
        raise AssertionError("unreachable")  # pragma: no cover

    def _started(self) -> RdProducer:
        if self._rd is None:
            raise TransactionFailed("the producer is closed")
        return self._rd

    async def begin(self) -> None:
        """Read the group metadata the offsets will carry, then begin: a rebalance that
        began (no metadata to read) defers the transaction before anything is begun."""
        rd = self._started()
        try:
            self._group = await self._group_metadata()
        except Exception as exc:
            raise TransactionDeferred(f"{type(exc).__name__}: {exc}") from None
        try:
            rd.handle.begin_transaction()
        except confluent_kafka.KafkaException as exc:
            raise _failed(exc) from None

    async def send(self, messages: Sequence[Message], *, one_by_one: bool) -> tuple[int, ...]:
        """Refused for size: the refused messages named. The broker refuses a whole batch,
        so each message of it is named: ``one_by_one`` sends each message once the previous
        one is acknowledged (a batch of its own) and stops at the first refusal, which is
        then exact."""
        rd = self._started()
        results = await (self._each_alone if one_by_one else self._all)(rd, messages)
        refused = tuple(i for i, r in enumerate(results) if isinstance(r, MessageSizeTooLargeError))
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None and not refused:
            raise TransactionFailed(f"{type(failed).__name__}: {failed}")
        return refused

    async def send_offsets(self, offsets: Mapping[TopicPartition, int]) -> None:
        positions = [
            confluent_kafka.TopicPartition(tp.topic, tp.partition, offset)
            for tp, offset in offsets.items()
        ]
        try:
            await _send_offsets(self._started().handle, positions, self._group)
        except confluent_kafka.KafkaException as exc:
            raise _failed(exc) from None

    async def commit(self) -> None:
        """Commit; made again while librdkafka calls the failure retriable.

        A commit that timed out goes on in the background and may already be accepted by
        the coordinator: an abort and a fresh producer would put the same outcomes in the
        next transaction, visible twice once the first commit completes.
        """
        handle = self._started().handle
        for attempt in itertools.count(1):
            try:
                await in_thread(handle.commit_transaction, _CALL_TIMEOUT_S)
                return
            except confluent_kafka.KafkaException as exc:
                error = exc.args[0]
                if error.fatal() or error.txn_requires_abort() or not error.retriable():
                    raise _failed(exc) from None
                log.warning("transaction_commit_retried", attempt=attempt, error=error.str())
            await asyncio.sleep(_COMMIT_RETRY_BACKOFF.delay_s(attempt))

    @staticmethod
    async def _all(rd: RdProducer, messages: Sequence[Message]) -> list[Any]:
        """Queue every message, then wait for every delivery report or the first failure.

        Each entry is the delivered message, its error, or None when the transaction failed
        before its report came: librdkafka holds the messages still queued in a failed
        transaction until the abort purges them (or they time out with the transaction).
        A message refused before it is queued fails like one the broker refused; after an
        error other than its size, the rest would be refused too and are not queued.
        """
        futures: list[asyncio.Future[Any]] = []
        for topic, value, key, headers in messages:
            try:
                futures.append(await rd.send(topic, value, key, headers))
            except KafkaError as exc:  # over the producer's own limit, or _STATE, _FATAL...
                futures.append(asyncio.get_running_loop().create_future())
                futures[-1].set_exception(exc)
                if not isinstance(exc, MessageSizeTooLargeError):
                    break
        if futures:  # a record may have no result to write (a stream that answered none)
            await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
        results: list[Any] = []
        for future in futures:
            if not future.done():
                # Settled by the abort's purge: its error is expected, and read here.
                future.add_done_callback(_read_outcome)
                results.append(None)
            else:
                results.append(future.exception() or future.result())
        return results

    @staticmethod
    async def _each_alone(rd: RdProducer, messages: Sequence[Message]) -> list[Any]:
        results: list[Any] = []
        for topic, value, key, headers in messages:
            try:
                results.append(await (await rd.send(topic, value, key, headers)))
            except KafkaError as exc:
                results.append(exc)
                break
        return results

    async def abandon(self, why: str) -> None:
        """Abort (readers move on at once), then close the producer: the next transaction
        starts a fresh one (same id, new epoch). After a batch refused for its size,
        librdkafka's next transaction on the same producer fails on the sequence gap
        ("skipped sequence numbers"), so the producer is not reused after any failure."""
        log.warning("transaction_failed", error=why)
        rd = self._rd
        if rd is None:
            return
        with contextlib.suppress(confluent_kafka.KafkaException):
            # The aborted records' fate does not matter: purged, queued and in flight alike.
            # Otherwise the abort waits for the batches sent after a refused one, which
            # the broker refuses for their sequence gap and librdkafka retries until the
            # transaction times out (TRANSACTION_TIMEOUT_MS): the partitions stall as long.
            rd.handle.purge(in_queue=True, in_flight=True, blocking=False)
        with contextlib.suppress(confluent_kafka.KafkaException):
            await in_thread(rd.handle.abort_transaction, _CALL_TIMEOUT_S)
        self._close("after a failed transaction")

    def _close(self, why: str) -> None:
        """Drop the producer: the next transaction starts a fresh one at once, while this
        one is destroyed in the background. librdkafka takes seconds to destroy a producer
        whose transaction failed with the coordinator out of reach (5 s and more after a
        broker restart), and every partition waited for it."""
        log.warning("transactional_producer_closed", reason=why)
        rd, self._rd = self._rd, None
        if rd is not None:
            retired = asyncio.get_running_loop().create_task(_stop_quietly(rd))
            self._retired.add(retired)
            retired.add_done_callback(self._retired.discard)

    async def stop(self) -> None:
        """Close the producer (an open transaction is aborted by the broker), and wait for the
        destruction of those closed before (each bounded). Idempotent."""
        rd, self._rd = self._rd, None
        if rd is not None:
            await _stop_quietly(rd)
        if self._retired:
            await asyncio.wait(set(self._retired))


def _failed(exc: confluent_kafka.KafkaException) -> TransactionFailed:
    """librdkafka's failure of a step, as a failed transaction (``fenced`` when the group
    coordinator refused this member's generation)."""
    error = exc.args[0]
    fenced = error.code() in _GROUP_FENCED
    if fenced:
        log.warning("transactional_producer_fenced", by="group coordinator", error=error.str())
    return TransactionFailed(error.str(), fenced=fenced)


async def _send_offsets(handle: confluent_kafka.Producer, positions: list[Any], group: Any) -> None:
    """``send_offsets_to_transaction``, bounded here as well: past its timeout and a grace,
    a retriable ``_TIMED_OUT`` (the transaction is then aborted and the producer replaced).

    The call runs on a daemon thread of its own: one that never returns is left to
    librdkafka, and the shared threads of the other calls never run short.
    """
    done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def call() -> None:
        if not done.set_running_or_notify_cancel():
            return  # given up before the thread ran
        try:
            handle.send_offsets_to_transaction(positions, group, _OFFSETS_TIMEOUT_S)
        except BaseException as exc:  # handed to the awaiting task
            done.set_exception(exc)
        else:
            done.set_result(None)

    threading.Thread(target=call, name="rdkafka-offsets", daemon=True).start()
    try:
        await asyncio.wait_for(asyncio.wrap_future(done), _OFFSETS_TIMEOUT_S + _OFFSETS_GRACE_S)
    except TimeoutError:
        error = confluent_kafka.KafkaError(
            confluent_kafka.KafkaError._TIMED_OUT,
            f"send_offsets_to_transaction still blocked after "
            f"{_OFFSETS_TIMEOUT_S + _OFFSETS_GRACE_S:.0f} s",
            retriable=True,
        )
        raise confluent_kafka.KafkaException(error) from None


def _read_outcome(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def _stop_quietly(rd: RdProducer) -> None:
    with contextlib.suppress(KafkaError, confluent_kafka.KafkaException, RuntimeError):
        await rd.stop()
