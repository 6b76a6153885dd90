"""An in-memory librdkafka producer, with a broker behind it that keeps what transactions commit.

What ``RdProducer`` and ``GroupTransactions`` use of ``confluent_kafka.Producer``. The
failures a real broker cannot be made to produce on demand are scripted on the
``Broker``: a record refused before it is queued (``_STATE``, ``_FATAL``,
``_UNKNOWN_TOPIC``), records held after a refused one until the abort purges them,
offsets refused (``REBALANCE_IN_PROGRESS``) or not answered past their timeout, a
commit that times out after the coordinator accepted it, a fatal error raised from
``poll``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import confluent_kafka

KafkaError = confluent_kafka.KafkaError

#: A delivery callback, its error (or None) and the record's value.
_Report = tuple[Callable[[Any, Any], None], Any, bytes | None]


def rd_error(code: int, *, fatal: bool = False, retriable: bool = False) -> Any:
    """A librdkafka error as confluent-kafka raises it."""
    error = KafkaError(code, f"scripted {code}", fatal=fatal, retriable=retriable)
    return confluent_kafka.KafkaException(error)


@dataclass
class Broker:
    """What every producer of a test writes to, and the failures scripted for them."""

    #: (topic, value) of the records of every committed transaction, in commit order.
    visible: list[tuple[str, bytes | None]] = field(default_factory=list)
    #: The offsets of every committed transaction.
    offsets: list[dict[tuple[str, int], int]] = field(default_factory=list)
    producers: list[FakeRdKafka] = field(default_factory=list)
    #: produce() of the n-th record of a transaction raises this (once).
    produce_errors: dict[int, confluent_kafka.KafkaException] = field(default_factory=dict)
    #: The n-th record of a transaction is refused for its size (once).
    refuse: set[int] = field(default_factory=set)
    #: Records queued after a refused one get no report until the abort purges them.
    hold_after_refusal: bool = False
    #: Raised by send_offsets_to_transaction, in turn.
    offsets_errors: list[confluent_kafka.KafkaException] = field(default_factory=list)
    #: send_offsets_to_transaction blocks until this is set, whatever its timeout (once).
    offsets_stuck: threading.Event | None = None
    #: Raised by commit_transaction, in turn, with whether the commit went through first.
    commit_errors: list[tuple[confluent_kafka.KafkaException, bool]] = field(default_factory=list)
    #: Raised once by poll.
    poll_error: confluent_kafka.KafkaException | None = None
    #: close() blocks until this is set (once): a destruction librdkafka takes long over.
    close_stuck: threading.Event | None = None

    def producer(self, config: dict[str, Any]) -> FakeRdKafka:
        made = FakeRdKafka(self, config)
        self.producers.append(made)
        return made


class FakeRdKafka:
    """One librdkafka producer: reports are delivered by poll, as librdkafka's are."""

    def __init__(self, broker: Broker, config: dict[str, Any]) -> None:
        self.broker = broker
        self.config = config
        self.calls: list[str] = []
        self._lock = threading.Lock()
        self._reports: list[_Report] = []
        self._held: list[_Report] = []
        self._txn: list[tuple[str, bytes | None]] = []
        self._txn_offsets: dict[tuple[str, int], int] = {}
        self._refused = False
        self._committed = False

    def list_topics(self, timeout: float | None = None) -> None:
        return None

    def init_transactions(self, timeout: float | None = None) -> None:
        self.calls.append("init")

    def begin_transaction(self) -> None:
        self.calls.append("begin")
        self._txn, self._refused, self._committed = [], False, False

    def produce(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        headers: Any = None,
        on_delivery: Callable[[Any, Any], None] | None = None,
    ) -> None:
        assert on_delivery is not None
        index = len(self._txn)
        error = self.broker.produce_errors.pop(index, None)
        if error is not None:
            raise error
        self._txn.append((topic, value))
        with self._lock:
            if index in self.broker.refuse:
                self.broker.refuse.discard(index)
                self._refused = True
                refused = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "too large")
                self._reports.append((on_delivery, refused, value))
            elif self._refused and self.broker.hold_after_refusal:
                self._held.append((on_delivery, None, value))
            else:
                self._reports.append((on_delivery, None, value))

    def poll(self, timeout: float = 0) -> int:
        error, self.broker.poll_error = self.broker.poll_error, None
        if error is not None:
            raise error
        with self._lock:
            reports, self._reports = self._reports, []
        for callback, failure, value in reports:
            callback(failure, value)
        if not reports:
            time.sleep(min(timeout, 0.005))  # as librdkafka's poll waits for events
        return len(reports)

    def flush(self, timeout: float | None = None) -> int:
        self.poll(0)
        return 0

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        self.calls.append("purge")
        self._purge()

    def _purge(self) -> None:
        with self._lock:
            purged = KafkaError(KafkaError._PURGE_QUEUE, "purged")
            self._reports += [(callback, purged, value) for callback, _, value in self._held]
            self._held = []

    def close(self) -> bool:
        stuck, self.broker.close_stuck = self.broker.close_stuck, None
        if stuck is not None:
            stuck.wait()
        self.calls.append("close")
        self.flush()
        return True

    def send_offsets_to_transaction(
        self, positions: list[Any], group: Any, timeout: float | None = None
    ) -> None:
        stuck, self.broker.offsets_stuck = self.broker.offsets_stuck, None
        if stuck is not None:
            stuck.wait()
            raise rd_error(KafkaError._TIMED_OUT, retriable=True)
        if self.broker.offsets_errors:
            raise self.broker.offsets_errors.pop(0)
        self._txn_offsets = {(p.topic, p.partition): p.offset for p in positions}

    def commit_transaction(self, timeout: float | None = None) -> None:
        self.calls.append("commit")
        if self._committed:
            return  # the commit that timed out went through: asked again, it succeeds
        if self.broker.commit_errors:
            error, went_through = self.broker.commit_errors.pop(0)
            if went_through:
                self._complete()
            raise error
        self._complete()

    def _complete(self) -> None:
        self.broker.visible += self._txn
        self.broker.offsets.append(self._txn_offsets)
        self._committed = True

    def abort_transaction(self, timeout: float | None = None) -> None:
        self.calls.append("abort")
        if self._committed:
            raise rd_error(KafkaError._STATE)  # a commit went through: nothing to abort
        if self._held:
            # librdkafka's abort waits for the records in flight; these are never answered.
            raise rd_error(KafkaError._TIMED_OUT, retriable=True)
        self._txn = []
