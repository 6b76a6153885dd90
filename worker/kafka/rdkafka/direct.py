"""Kafka written and read without a group on librdkafka (``worker.kafka.direct``).

The writer is the publisher's ``RdProducer`` (idempotent, ``acks=all``), named for the
command, choosing a key's partition as aiokafka does. The reader is a
``confluent_kafka.Consumer`` used with ``assign``: its blocking calls (fetching, asking
offsets, closing) run on daemon threads, off the event loop, one at a time.
confluent-kafka requires a group id: the reader's is never joined (no subscription) and
nothing is committed under it.

Two things librdkafka does its own way. An OAUTHBEARER token is asked for from a poll
(``oauth_cb``): the reader polls once before it asks a broker anything. And the position
of a partition assigned again is the one it had reached before until a record is
consumed: the reader unassigns everything first, and counts a partition's position from
its assigned offset until librdkafka reports one.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import confluent_kafka

from worker.flow.bounded import CLOSE_TIMEOUT_S
from worker.kafka.rdkafka import config as rdkafka_config
from worker.kafka.rdkafka import log as rdkafka_log
from worker.kafka.rdkafka.publisher import RdProducer
from worker.kafka.rdkafka.threads import in_thread, teardown
from worker.kafka.rdkafka.types import from_rd_error, record_of
from worker.kafka.types import ConsumerRecord, KafkaError, TopicPartition
from worker.settings import KafkaAuthSettings, KafkaSettings

__all__ = ["RdReader", "reader", "reader_config", "writer"]

_T = TypeVar("_T")

#: Bound on reaching a broker at start, and on one offsets request.
_REQUEST_TIMEOUT_S = 10.0
#: Most records one fetch returns.
_FETCH_LIMIT = 500
#: Longest wait of the broker for records before it answers a fetch.
_FETCH_WAIT_MAX_MS = 50
#: Kafka's code of a topic the principal may not read: reading on would only repeat it.
_TOPIC_AUTHORIZATION_FAILED = 29


class RdReader:
    """A librdkafka consumer without a group (``worker.kafka.direct.Reader``)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = dict(config)
        self._consumer: confluent_kafka.Consumer | None = None
        #: Held by every call on the consumer and by its closing: one at a time, and never
        #: closed under a call still running on a thread its caller gave up on.
        self._lock = threading.Lock()
        self._starts: dict[TopicPartition, int] = {}

    async def start(self) -> None:
        try:
            self._consumer = confluent_kafka.Consumer(self._config)
        except confluent_kafka.KafkaException as exc:  # a TLS file librdkafka cannot load
            raise rdkafka_config.config_refused(exc.args[0].str()) from None
        try:
            await self._call(lambda consumer: consumer.poll(0))  # serves oauth_cb first
            await self._call(lambda c: c.list_topics(timeout=_REQUEST_TIMEOUT_S))
        except BaseException:
            await self.stop()
            raise

    async def _call(self, call: Callable[[confluent_kafka.Consumer], _T]) -> _T:
        """``call(consumer)`` on a daemon thread, the consumer's lock held; librdkafka's
        errors as the edge's (KafkaError)."""

        def locked() -> _T:
            with self._lock:
                if self._consumer is None:
                    raise KafkaError("the reader is closed")
                try:
                    return call(self._consumer)
                except confluent_kafka.KafkaException as exc:
                    raise from_rd_error(exc) from None

        return await in_thread(locked)

    async def offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, range]:
        found: dict[TopicPartition, range] = {}
        for tp in partitions:
            partition = confluent_kafka.TopicPartition(tp.topic, tp.partition)
            # librdkafka asks for the last stable offset under read_committed.
            low, high = await self._call(functools.partial(_watermarks, partition))
            found[tp] = range(low, high)
        return found

    async def assign(self, starts: Mapping[TopicPartition, int]) -> None:
        partitions = [
            confluent_kafka.TopicPartition(tp.topic, tp.partition, offset)
            for tp, offset in starts.items()
        ]

        def assign(consumer: confluent_kafka.Consumer) -> None:
            # Unassigned first: else a partition assigned again reports its old position.
            consumer.unassign()
            consumer.assign(partitions)

        await self._call(assign)
        self._starts = dict(starts)

    async def position(self, tp: TopicPartition) -> int:
        asked = [confluent_kafka.TopicPartition(tp.topic, tp.partition)]
        (found,) = await self._call(lambda consumer: consumer.position(asked))
        offset = int(found.offset)
        # No record consumed yet since the assignment: the assigned offset.
        return offset if offset >= 0 else self._starts[tp]

    async def fetch(self, timeout_s: float) -> list[ConsumerRecord[bytes, bytes]]:
        messages = await self._call(functools.partial(_fetch, timeout_s=timeout_s))
        records = []
        for message in messages:
            error = message.error()
            if error is None:
                records.append(record_of(message))
            elif error.fatal() or (
                message.topic() is not None and error.code() == _TOPIC_AUTHORIZATION_FAILED
            ):
                raise from_rd_error(error)
            # Else librdkafka tries again by itself (a broker down, the lookup of the group
            # never joined refused): the caller bounds how long it waits for records.
        return records

    async def stop(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is None:
            return

        def close() -> None:
            with self._lock:
                consumer.close()  # its librdkafka threads are joined here

        await teardown(close, "reader", CLOSE_TIMEOUT_S)


def _watermarks(partition: confluent_kafka.TopicPartition, consumer: Any) -> tuple[int, int]:
    low, high = consumer.get_watermark_offsets(partition, timeout=_REQUEST_TIMEOUT_S, cached=False)
    return int(low), int(high)


def _fetch(consumer: Any, *, timeout_s: float) -> list[Any]:
    """What librdkafka holds, at once; when it holds nothing, the first record to come within
    ``timeout_s`` and those that came with it (``consume`` alone would wait out the whole
    timeout for a full batch)."""
    messages: list[Any] = consumer.consume(_FETCH_LIMIT, 0)
    if messages or timeout_s <= 0:
        return messages
    first = consumer.poll(timeout_s)
    if first is None:
        return []
    return [first, *consumer.consume(_FETCH_LIMIT - 1, 0)]


def _client_id(kafka: KafkaSettings, suffix: str) -> str:
    return f"{kafka.client_id}-{suffix}"


def writer(
    kafka: KafkaSettings, auth: KafkaAuthSettings, *, suffix: str, max_request_bytes: int
) -> RdProducer:
    """An idempotent producer of records up to ``max_request_bytes``, its client id
    ``<client id>-<suffix>`` (ConfigError for unusable security settings)."""
    config = rdkafka_config.producer_config(kafka, auth, max_request_bytes=max_request_bytes)
    # A key's partition as aiokafka and the Java client choose it (librdkafka's default
    # hashes another way): a request replayed, or produced, lands beside the other records
    # of its key, and a stateful model sees them in order.
    config |= {"client.id": _client_id(kafka, suffix), "partitioner": "murmur2_random"}
    return RdProducer(config)


def reader_config(kafka: KafkaSettings, auth: KafkaAuthSettings, *, suffix: str) -> dict[str, Any]:
    """The reader's properties: read_committed, no commits, a group id never joined."""
    client_id = _client_id(kafka, suffix)
    return {
        "bootstrap.servers": kafka.bootstrap_servers,
        "client.id": client_id,
        "group.id": client_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        # An offset deleted by retention since it was asked for: read from the oldest left.
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        # A fetch left waiting at the end of a partition (the broker holds it up to this
        # long) holds back the first fetch after an assignment: librdkafka's 500 ms made
        # every assignment after the first wait half a second.
        "fetch.wait.max.ms": _FETCH_WAIT_MAX_MS,
        **rdkafka_config.security_config(auth),
        **rdkafka_log.callbacks(),
    }


def reader(kafka: KafkaSettings, auth: KafkaAuthSettings, *, suffix: str) -> RdReader:
    """A consumer without a group, ``read_committed``, its client id ``<client id>-<suffix>``
    (ConfigError for unusable security settings)."""
    return RdReader(reader_config(kafka, auth, suffix=suffix))
