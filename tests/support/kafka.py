"""Kafka helpers for the tests: a cluster of one's own, fresh topics, send and collect."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaClient, AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy
from aiokafka.structs import ConsumerRecord, TopicPartition

from devtools.devstack.kafka import KafkaCluster, ensure_kafka_jars
from devtools.samples import SampleRequest
from tests.support.servers import KafkaUnderTest
from worker.wire import header_value


@contextlib.contextmanager
def local_kafka(nodes: int) -> Iterator[KafkaCluster]:
    """A Kafka cluster of its own (``nodes`` KRaft nodes), stopped with nothing left behind."""
    with tempfile.TemporaryDirectory() as tmp:
        cluster = KafkaCluster(ensure_kafka_jars(log=lambda _: None), Path(tmp), nodes=nodes)
        cluster.start()
        try:
            yield cluster
        finally:
            cluster.stop()
        assert cluster.running_nodes() == []


@dataclass
class SilentBroker:
    """A TCP listener that accepts connections and never answers: a broker that hangs."""

    address: str
    #: Set once a client has connected.
    connected: threading.Event


@contextlib.contextmanager
def silent_broker() -> Iterator[SilentBroker]:
    """A local port that accepts Kafka connections and never replies (closed on exit).

    A client's start-up then waits on its requests' timeouts, as against a broker whose
    process is frozen, without freezing a broker other tests use.
    """
    server = socket.create_server(("127.0.0.1", 0))
    connected = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener closed: done
            while True:
                held.append(server.accept()[0])
                connected.set()

    thread = threading.Thread(target=accept, name="silent-broker", daemon=True)
    thread.start()
    try:
        yield SilentBroker(f"127.0.0.1:{server.getsockname()[1]}", connected)
    finally:
        server.close()
        for conn in held:
            conn.close()
        thread.join(5)


@dataclass
class Topics:
    input: str
    output: str
    dlq: str
    group: str

    @classmethod
    def fresh(cls, unique: str) -> Topics:
        return cls(f"req-{unique}", f"res-{unique}", f"dlq-{unique}", f"grp-{unique}")


async def create(kafka: KafkaUnderTest, topics: Topics, partitions: int = 1) -> None:
    await kafka.create_topics([topics.input], partitions=partitions)
    await kafka.create_topics([topics.output, topics.dlq], partitions=1)


async def send(
    bootstrap: str,
    topic: str,
    requests: Sequence[SampleRequest],
    partition: int | None = None,
    keys: Sequence[bytes | None] | None = None,
) -> None:
    """Produce requests keyed by request id (or by ``keys``) and wait for every ack."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        futures = [
            await producer.send(
                topic,
                r.value,
                key=r.request_id.encode() if keys is None else keys[i],
                headers=r.headers,
                partition=partition,
            )
            for i, r in enumerate(requests)
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


class _RawKey(str):
    """A header key whose bytes are ``raw`` as written (aiokafka's batch builder encodes
    each key with ``encode``), so a key that is not UTF-8 can be written at all."""

    raw: bytes = b""

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return self.raw


def _raw_key(raw: bytes) -> str:
    key = _RawKey(raw.decode("latin-1"))
    key.raw = raw
    return key


async def send_raw_headers(
    bootstrap: str,
    topic: str,
    partition: int,
    records: Sequence[tuple[bytes | None, bytes | None, Sequence[tuple[bytes, bytes | None]]]],
) -> list[int]:
    """Produce (key, value, headers) records whose header keys are raw bytes, in one batch;
    their offsets.

    Kafka's protocol carries a header key as bytes, and a producer speaking it directly
    (librdkafka's C API) can send keys that are not UTF-8. No Python client can (aiokafka
    and confluent-kafka take keys as text), so the batch is built with aiokafka's
    pure-Python batch builder and sent as a Produce request of its own.
    """
    builder = _DefaultRecordBatchBuilderPy(
        magic=2,
        compression_type=0,
        is_transactional=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1 << 20,
    )
    for delta, (key, value, headers) in enumerate(records):
        written = [(_raw_key(name), header) for name, header in headers]
        assert builder.append(delta, timestamp=None, key=key, value=value, headers=written)
    batch = bytes(builder.build())
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        await client.add_topic(topic)
        leader = client.cluster.leader_for_partition(TopicPartition(topic, partition))
        request = ProduceRequest(
            transactional_id=None,
            required_acks=-1,
            timeout=30_000,
            topics=[(topic, [(partition, batch)])],
        )
        response = await client.send(leader, request)
    finally:
        await client.close()
    ((_, partitions),) = response.topics
    ((_, error_code, base_offset, *_),) = partitions
    assert error_code == 0, f"produce to {topic}[{partition}]: error {error_code}"
    return [base_offset + delta for delta in range(len(records))]


@dataclass
class Collected:
    results: dict[str, ConsumerRecord[bytes, bytes]] = field(default_factory=dict)
    dead_letters: dict[str, ConsumerRecord[bytes, bytes]] = field(default_factory=dict)
    duplicates: int = 0
    # (topic, partition, offset) already read, so that collecting again from the
    # start does not count the same records twice.
    seen: set[tuple[str, int, int]] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.results) + len(self.dead_letters)

    def add(self, record: ConsumerRecord[bytes, bytes], output_topic: str) -> None:
        """Count one record read from the output or dead-letter topic (once per position)."""
        position = (record.topic, record.partition, record.offset)
        if position in self.seen:
            return
        self.seen.add(position)
        target = self.results if record.topic == output_topic else self.dead_letters
        rid = request_id_of(record)
        if rid in self.results or rid in self.dead_letters:
            self.duplicates += 1
        target[rid] = record


def request_id_of(record: ConsumerRecord[bytes, bytes]) -> str:
    found = header_value(record.headers, "x-request-id")
    if found is not None:
        return found.decode()
    return (record.key or b"").decode()


async def collect(
    bootstrap: str,
    topics: Topics,
    expected: int,
    timeout_s: float = 60.0,
    into: Collected | None = None,
) -> Collected:
    """Read results and dead letters until ``expected`` distinct request ids have answers."""
    got = into or Collected()
    consumer = AIOKafkaConsumer(
        topics.output,
        topics.dlq,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level="read_committed",
    )
    await consumer.start()
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < expected:
            assert time.monotonic() < deadline, f"only {len(got)}/{expected} answers in time"
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for record in records:
                    got.add(record, topics.output)
    finally:
        await consumer.stop()
    return got


async def read_all(bootstrap: str, topics: Topics, timeout_s: float = 30.0) -> Collected:
    """Every committed result and dead letter there is now: both topics read to their end
    (the last stable offset, for this ``read_committed`` reader), so duplicates show."""
    got = Collected()
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level="read_committed"
    )
    await consumer.start()
    deadline = time.monotonic() + timeout_s
    try:
        # One partition each, as create() makes them.
        parts = [TopicPartition(topics.output, 0), TopicPartition(topics.dlq, 0)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        ends = await consumer.end_offsets(parts)
        while any([await consumer.position(tp) < ends[tp] for tp in parts]):
            assert time.monotonic() < deadline, f"{topics.output}/{topics.dlq} not read in time"
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for record in records:
                    got.add(record, topics.output)
    finally:
        await consumer.stop()
    return got


@dataclass
class Streams:
    """Every result and dead letter read, in topic order, grouped by request id."""

    results: dict[str, list[ConsumerRecord[bytes, bytes]]] = field(default_factory=dict)
    dead_letters: dict[str, list[ConsumerRecord[bytes, bytes]]] = field(default_factory=dict)

    def finished(self, request_id: str) -> bool:
        """A result that is final (each mode) or whole (final mode), or a dead letter
        after the results it says were published."""
        if request_id in self.dead_letters:
            letter = self.dead_letters[request_id][-1]
            published = int(header_value(letter.headers, "x-responses-published") or b"0")
            return len(self.results.get(request_id, [])) >= published
        last = (self.results.get(request_id) or [None])[-1]
        return last is not None and header_value(last.headers, "x-response-final") != b"false"


async def collect_streams(
    bootstrap: str,
    topics: Topics,
    request_ids: Collection[str],
    timeout_s: float = 60.0,
    isolation_level: str = "read_committed",
    until: Callable[[Streams], bool] | None = None,
) -> Streams:
    """Read results and dead letters until every request in ``request_ids`` is finished
    (or, with ``until``, until it says enough was read)."""
    got = Streams()

    def enough() -> bool:
        return until(got) if until is not None else all(got.finished(r) for r in request_ids)

    consumer = AIOKafkaConsumer(
        topics.output,
        topics.dlq,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level=isolation_level,
    )
    await consumer.start()
    deadline = time.monotonic() + timeout_s
    try:
        while not enough():
            missing = [rid for rid in request_ids if not got.finished(rid)]
            assert time.monotonic() < deadline, f"unfinished after {timeout_s} s: {missing[:5]}"
            batch = await consumer.getmany(timeout_ms=500)
            for tp in sorted(batch):
                for record in batch[tp]:
                    target = got.results if record.topic == topics.output else got.dead_letters
                    target.setdefault(request_id_of(record), []).append(record)
    finally:
        await consumer.stop()
    return got


def headers_dict(headers: Sequence[tuple[str, bytes]]) -> dict[str, bytes]:
    return dict(headers)
